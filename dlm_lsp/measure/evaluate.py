"""`dlm-lsp eval`: fills held-out holes through the server's own path and scores them.

Holes (dlm_lsp/measure/holes.py): `line`, `block` and `middle`, cut with tree-sitter from the held-out files of
the training split (or the .py files of --source DIR) with a fixed seed. Each hole is filled the way
the server fills a cursor: the document without the middle -> dlm_lsp.fill.context.build_request ->
EngineService.run_now(FillJob) (default DecodeOptions) -> post-processing. Per kind:
  exact         shown fill == middle, trailing whitespace stripped (per line)
  edit_sim      1 - Levenshtein / max length (CrossCodeEval), shown fill vs middle
  syntax_clean  share of raw fills (before post-processing) that leave the file with no more
                tree-sitter ERROR / MISSING nodes than it had
  dup_suffix    share of raw fills whose first line is within 5% edit distance of the suffix's first
                non-empty line (Tabby's duplicate filter)
  p50/p95_ms    wall time per fill: context + engine + post-processing
  shown         share of holes where a fill of >= 2 non-space characters is shown (after the gate)
  accepted      share of those shown fills that the true text starts with: what a user would keep
  kept chars    accepted_chars: characters of the accepted shown fills per hole (a share alone
                rewards showing less; this one falls when fills are hidden or cut short needlessly)
  strict        share of shown fills strictly accepted: accepted, and with a letter or digit and >= 3
                non-space characters (a lone `""`, `(`, `:` or `if` does not count; issue 38)
  strict chars  strict_chars: characters of the strictly accepted shown fills per hole
With more than one kind the --json also has "all": these acceptance measures (and the curve) over
every kind's holes together. --samples writes a `strict` per hole.
The confidence gate (the server's minConfidence) hides fills the engine is less sure of; --curve
writes accepted vs shown over every gate as a PNG (and the points, with strict and strict_chars, into
--json), from one pass. "gates" in the --json (and a line per kind under the table) names each kind's
gate with the most strict chars, and whether some gate that still shows a fill reaches strict >= 0.40.
--corpus DIR takes the holes from a corpus built by `dlm-lsp corpus`: --heldout files (its held-out
stdlib and package files), packages (whole packages the model never saw) or all.
--ar-model runs an autoregressive FIM twin (PSM: <|fim_prefix|>p<|fim_suffix|>s<|fim_middle|> ->
middle <|endoftext|>, greedy with a KV cache: engine.decode.autoregressive) on the same holes, requests and
post-processing. --oracle sends the true middle through the same path: the pipeline's ceiling.
--reuse-typing N measures approximate per-keystroke context reuse (engine/decode/reuse.py) on the same
holes: for each hole the last N characters before the cursor are taken out of the document and
typed back one at a time, each keystroke a fill with the hole's session key and DecodeOptions.reuse
on, then the hole's own request is filled the same way and scored ("diffusion+reuse", beside the
plain "diffusion" fills of the same requests, which recompute their context in full). Its p50/p95_ms
time the scored fill only; the JSON's "reuse" adds the rows reused and forwarded per scored fill and
the staleness policy's outcomes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dlm_lsp.fill.gate import kind_gate
from dlm_lsp.measure.holes import KINDS, Hole, count_syntax_errors, cut_holes

if TYPE_CHECKING:
    from dlm_lsp.fill.context import FillRequest
    from dlm_lsp.fill.documents import Document
    from dlm_lsp.fill.gate import Calibrator
    from engine.api import DecodeOptions, FillJob
    from engine.model.transformer import Transformer
    from engine.serve.service import EngineService
    from engine.tokenizer import TextTokenizer

# the post-processing of a raw fill: (doc, request, raw, confidence, min_confidence, calibrator) ->
# (shown text, replace_len, calibrated score or None)
PostProcess = Callable[..., tuple[str, int, float | None]]

DUP_TOLERANCE = 0.05  # Tabby drops a completion within 5% edit distance of the suffix
METRIC_KEYS = ("holes", "exact", "edit_sim", "syntax_clean", "dup_suffix", "p50_ms", "p95_ms")  # per kind, in --json


# ----------------------------------------------------------------------------- metrics


def levenshtein(a: str, b: str) -> int:
    """Returns the edit distance (insert, delete, substitute) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(pred: str, ref: str) -> float:
    """Returns 1 - Levenshtein(pred, ref) / max(len) (1.0 for two empty strings)."""
    m = max(len(pred), len(ref))
    return 1.0 if m == 0 else 1.0 - levenshtein(pred, ref) / m


def normalize(text: str) -> str:
    """Text with trailing whitespace stripped from every line and from the end."""
    return "\n".join(ln.rstrip() for ln in text.split("\n")).rstrip()


def exact_match(pred: str, ref: str) -> bool:
    return normalize(pred) == normalize(ref)


def syntax_clean(hole: Hole, fill: str, original_errors: int | None = None) -> bool:
    """True when the file with `fill` in the hole has no more ERROR/MISSING nodes than the original."""
    base = count_syntax_errors(hole.text) if original_errors is None else original_errors
    return count_syntax_errors(hole.filled(fill)) <= base


def repeats_suffix(fill: str, suffix: str, tolerance: float = DUP_TOLERANCE) -> bool:
    """True when the fill's first non-empty line is within `tolerance` edit distance of the suffix's
    first non-empty line (the fill repeats what already follows the cursor)."""
    first = next((ln.strip() for ln in fill.split("\n") if ln.strip()), "")
    after = next((ln.strip() for ln in suffix.split("\n") if ln.strip()), "")
    if not first or not after:
        return False
    return levenshtein(first, after) <= tolerance * max(len(first), len(after))


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; 0.0 for no data."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ----------------------------------------------------------------------------- the fill path


@dataclass
class Sample:
    """One filled hole."""

    raw: str  # engine output, padding dropped, before post-processing
    shown: str  # what the editor would show
    ms: float  # context + engine + post-processing
    engine_ms: float
    steps: int
    tokens: int
    server_kind: str  # the hole kind the server's context builder saw
    replace_len: int = 0  # the shown fill also replaces this many characters after the cursor
    confidence: float = 1.0  # what the gate compares: the calibrated score, else the engine's confidence
    ungated: str | None = None  # what would be shown with no confidence gate (None: same as shown)
    raw_confidence: float = 1.0  # the engine's confidence (Fill.confidence)
    features: list[float] | None = None  # calibrate.features of the ungated fill (None: nothing to show)
    ungated_replace_len: int = 0  # replace_len of the ungated fill


def _request(hole: Hole, neighbours: str = "") -> tuple[Document, FillRequest]:
    """(document, FillRequest) the server builds for the cursor at the hole (the middle removed);
    `neighbours`: the cross-file text of the other open documents (context.neighbour_text)."""
    from dlm_lsp.fill.context import build_request
    from dlm_lsp.fill.documents import Document

    doc = Document(f"file:///eval/{hole.key.replace(':', '/')}", "python", 1, hole.document)
    return doc, build_request(doc, hole.a, neighbours=neighbours)


def sibling_files(files: dict[str, str], n: int) -> dict[str, list[str]]:
    """For --neighbours: each file's `n` "other open documents", the evaluated files in the same
    folder of the same source (key up to its last "/"), nearest in key order first."""
    by_dir: dict[str, list[str]] = {}
    for key in sorted(files):
        by_dir.setdefault(key.rsplit("/", 1)[0] if "/" in key else key.split(":", 1)[0], []).append(key)
    out: dict[str, list[str]] = {}
    for keys in by_dir.values():
        for i, key in enumerate(keys):
            others = sorted((k for k in keys if k != key), key=lambda k: (abs(keys.index(k) - i), k))
            out[key] = others[:n]
    return out


def package_files(files: dict[str, str]) -> dict[str, list[str]]:
    """For --retrieve package: each file's workspace, the other evaluated files of its package (its
    key up to the first "/": a held-out package's files, or the held-out files of the stdlib's
    top folder)."""
    by_pkg: dict[str, list[str]] = {}
    for key in sorted(files):
        by_pkg.setdefault(key.split("/", 1)[0], []).append(key)
    return {k: [o for o in by_pkg[k.split("/", 1)[0]] if o != k] for k in files}


def retrieval_fn(files: dict[str, str], scope: str, n: int = 0) -> Callable[[Hole], str]:
    """For --retrieve: fn(hole) -> the cross-file text the server would retrieve for it
    (dlm_lsp.fill.retrieval), from the hole's `n` neighbours (scope "neighbours", sibling_files) or its
    package's other files (scope "package")."""
    from dlm_lsp.fill.retrieval import SNIPPET_CHARS, SnippetIndex, cross_file_text

    if scope == "neighbours":
        if n <= 0:
            raise ValueError("--retrieve neighbours needs --neighbours N")
        sib = sibling_files(files, n)
        group = {k: (k, tuple(sib.get(k, ()))) for k in files}
    elif scope == "package":  # one index per package; a file's own chunks are excluded from its search
        group = {}
        for k, others in package_files(files).items():
            group[k] = (k.split("/", 1)[0], tuple(sorted(others + [k])) if others else ())
    else:
        raise ValueError(f"--retrieve: unknown scope {scope!r} (neighbours or package)")
    indexes: dict[str, SnippetIndex] = {}
    for name, srcs in group.values():  # built before any fill is timed, as the server's walk is
        if srcs and name not in indexes:
            index = indexes[name] = SnippetIndex()
            for o in srcs:
                index.add(o, files[o])

    def fn(hole: Hole) -> str:
        name, srcs = group.get(hole.key, (hole.key, ()))
        if not srcs:
            return ""
        index = indexes[name]
        return cross_file_text(index, hole.document, hole.a, SNIPPET_CHARS, exclude=hole.key)

    return fn


def workspace_memories(files: dict[str, str], service: EngineService) -> None:
    """For --retrieve package: each package's evaluated files given to `service` as a workspace
    memory named after the package (DecodeOptions.workspace_ngram; DiffusionFiller names it and the
    hole's file in each job, whose own counts the engine leaves out, as the server's jobs name the
    filled document)."""
    by_pkg: dict[str, dict[str, str]] = {}
    for key in sorted(files):  # counted before any fill is timed, as the server's walk is
        by_pkg.setdefault(key.split("/", 1)[0], {})[key] = files[key]
    for pkg, texts in by_pkg.items():
        service.workspace_files(pkg, texts)


def _postprocessor() -> tuple[str, PostProcess]:
    """Returns (name, fn(doc, request, raw) -> (shown text, replace_len)): the server's
    post-processing (dlm_lsp.fill.postprocess.finish with its syntax check) when it is importable, else
    the request's stop rules alone."""
    try:
        from dlm_lsp.fill.postprocess import SyntaxCheck, finish
    except ImportError:
        return (
            "stop rules only (dlm_lsp.fill.postprocess.finish not importable)",
            lambda doc, req, raw, confidence=1.0, min_confidence=0.0, calibrator=None: (
                apply_stop_rules(req, raw),
                0,
                None,
            ),
        )

    def run(
        doc: Document,
        req: FillRequest,
        raw: str,
        confidence: float = 1.0,
        min_confidence: float = 0.0,
        calibrator: Calibrator | None = None,
    ) -> tuple[str, int, float | None]:
        check = SyntaxCheck(doc.text, doc.tree, doc.parser, req.offset) if doc.tree is not None else None
        out = finish(req, raw, check, confidence=confidence, min_confidence=min_confidence, calibrator=calibrator)
        return out.text, out.replace_len, out.score

    return "dlm_lsp.fill.postprocess.finish + SyntaxCheck", run


def apply_stop_rules(req: FillRequest, raw: str) -> str:
    """Minimal post-processing from the request's stop rules: one line for line/middle holes; for
    blocks, cut at the first non-blank line indented less than the block."""
    from dlm_lsp.fill.context import indent_width

    text = raw
    if req.stop.single_line:
        text = text.split("\n", 1)[0]
    elif req.stop.block_indent is not None:
        lines = text.split("\n")
        keep = [lines[0]]
        for ln in lines[1:]:
            if ln.strip() and indent_width(ln) < req.stop.block_indent:
                break
            if req.stop.stop_at_blank_line and not ln.strip():
                break
            keep.append(ln)
        text = "\n".join(keep)
    return text.rstrip()


class Filler:
    """The server's path around a decoder: context -> decode(hole, request) -> post-processing.
    Subclasses give decode(); it returns (raw text, steps, tokens)."""

    # the server's gate on shown fills (InitializationOptions.min_confidence, else the model's: one,
    # or one per hole kind, dlm_lsp.fill.gate.kind_gate)
    min_confidence: float | dict[str, float] = 0.0
    neighbours: dict[str, str] | None = None  # hole key -> cross-file text (--neighbours), None: none
    # --retrieve: fn(hole) -> cross-file text (retrieved snippets), replacing `neighbours`
    snippets: Callable[[Hole], str] | None = None
    # --retrieve package: jobs name their package's workspace memory (workspace_memories); a function
    # of the hole names the memory itself (docs/research/scripts/workspace_order_eval.py)
    workspace: bool | Callable[[Hole], str] = False
    last_confidence = 1.0  # the engine's confidence in the fill decode() returned last
    # the model's calibrated gate (calibrate.Calibrator); None: the raw confidence is gated
    calibrator: Calibrator | None = None

    def __init__(self) -> None:
        self.post_name, self.post = _postprocessor()

    def decode(self, hole: Hole, req: FillRequest) -> tuple[str, int, int]:
        raise NotImplementedError

    def cross_file(self, hole: Hole) -> str:
        """The cross-file text of the hole's fill: retrieved snippets (--retrieve), else its file's
        neighbours' starts (--neighbours), else nothing."""
        if Filler.snippets is not None:
            return Filler.snippets(hole)
        return (self.neighbours or {}).get(hole.key, "")

    def before(self, hole: Hole) -> None:
        """Runs before a hole's timed fill (the typed keystrokes of TypedReuseFiller); nothing here."""

    def __call__(self, hole: Hole) -> Sample:
        self.before(hole)
        t0 = time.perf_counter()
        doc, req = _request(hole, self.cross_file(hole))
        t1 = time.perf_counter()
        raw, steps, tokens = self.decode(hole, req)
        engine_ms = (time.perf_counter() - t1) * 1000
        # post-processed without the gate, then gated: the same as gating inside finish(), whose first
        # filter the gate is, and the curve over every gate comes from this one pass
        ungated, replace_len, score = self.post(doc, req, raw, self.last_confidence, 0.0, self.calibrator)
        conf = score if self.calibrator is not None and score is not None else self.last_confidence
        gate = kind_gate(self.min_confidence, req.hole_kind)  # per hole kind, as the server's fill_gate
        shown = ungated if conf >= gate or not ungated.strip() else ""
        ms = (time.perf_counter() - t0) * 1000
        from dlm_lsp.fill.gate import features

        feats = features(req, ungated, self.last_confidence, replace_len) if ungated.strip() else None
        return Sample(
            raw,
            shown,
            ms,
            engine_ms,
            steps,
            tokens,
            req.hole_kind,
            replace_len if shown else 0,
            conf,
            ungated,
            self.last_confidence,
            feats,
            replace_len,
        )


class DiffusionFiller(Filler):
    """The diffusion engine as the server runs it: EngineService.run_now(FillJob)."""

    def __init__(
        self,
        model: str | None,
        device: str = "cpu",
        threads: int | None = None,
        budget_ms: float | None = None,
        options: DecodeOptions | None = None,
    ) -> None:
        from engine.api import DecodeOptions
        from engine.serve.service import EngineService

        super().__init__()
        self.options = options or DecodeOptions()
        self.budget_ms = budget_ms
        self.service = EngineService(model, device=device, threads=threads)
        self.service.load()

    def decode(self, hole: Hole, req: FillRequest) -> tuple[str, int, int]:
        from dlm_lsp.fill.context import to_fill_job

        deadline = time.monotonic() + self.budget_ms / 1000 if self.budget_ms else None
        job = to_fill_job(req, deadline, options=dataclasses.replace(self.options))
        if Filler.workspace:
            space = Filler.workspace(hole) if callable(Filler.workspace) else hole.key.split("/", 1)[0]
            job.workspace, job.document = space, hole.key
        fill = self.service.run_now(job)
        self.last_confidence = fill.confidence
        return fill.text, fill.steps, fill.tokens


class TypedReuseFiller(DiffusionFiller):
    """The same engine with approximate context reuse (DecodeOptions.reuse) on: before each hole the
    last `typing` characters before the cursor are typed one at a time, a fill per keystroke under
    the hole's own session key, so the scored fill reuses the context the keystrokes left."""

    def __init__(self, base: DiffusionFiller, typing: int) -> None:
        Filler.__init__(self)
        self.service, self.budget_ms, self.min_confidence = base.service, base.budget_ms, base.min_confidence
        self.calibrator = getattr(base, "calibrator", None)
        self.options = dataclasses.replace(base.options, reuse=True)
        self.typing = typing
        self.session: str | None = None
        self.holes = 0
        self.rows: list[tuple[int, int]] = []  # (forwarded, reused) rows of each scored fill
        self.outcomes_before = dict(self.service._reuse.stats)
        self.same = (0.0, 0.0)  # set by run_eval: share of holes with the same raw / shown fill as without reuse

    def _job(self, req: FillRequest, deadline: float | None = None) -> FillJob:
        from dlm_lsp.fill.context import to_fill_job

        job = to_fill_job(req, deadline, options=dataclasses.replace(self.options))
        job.session = self.session
        return job

    def before(self, hole: Hole) -> None:
        self.holes += 1
        self.session = f"eval-reuse-{self.holes}"  # a fresh document per hole: no reuse across holes
        a, text = hole.a, hole.document
        near = self.cross_file(hole)  # --neighbours / --retrieve, as the scored fill has them
        for k in range(min(self.typing, a), 0, -1):  # the cursor k characters back, those k not typed yet
            typed = Hole(hole.kind, hole.key, text[: a - k] + text[a:], a - k, a - k)  # its document: that text
            _, req = _request(typed, near)
            self.service.run_now(self._job(req))

    def decode(self, hole: Hole, req: FillRequest) -> tuple[str, int, int]:
        deadline = time.monotonic() + self.budget_ms / 1000 if self.budget_ms else None
        fill = self.service.run_now(self._job(req, deadline))
        self.last_confidence = fill.confidence
        self.rows.append((fill.forwarded_tokens, fill.reused_tokens))
        return fill.text, fill.steps, fill.tokens

    def summary(self) -> dict[str, Any]:
        """Rows reused / forwarded per scored fill and the staleness policy's outcomes over the run."""
        fwd = [f for f, _ in self.rows]
        stats = self.service._reuse.stats
        return {
            "typing": self.typing,
            "reuse_budget": self.options.reuse_budget,
            # holes whose fill with reuse is the plain fill's (raw engine text, what is shown)
            "same_raw_share": round(self.same[0], 4),
            "same_shown_share": round(self.same[1], 4),
            "scored_fills": len(self.rows),
            "reused_share": round(sum(u > 0 for _, u in self.rows) / max(1, len(self.rows)), 4),
            "reused_tokens_mean": round(statistics.fmean([u for _, u in self.rows]), 1) if self.rows else 0.0,
            "forwarded_tokens_mean": round(statistics.fmean(fwd), 1) if fwd else 0.0,
            "outcomes": {k: stats[k] - self.outcomes_before.get(k, 0) for k in type(self.service._reuse).OUTCOMES},
        }


class AutoregressiveFiller(Filler):
    """The AR twin on the same requests: greedy FIM decoding with a KV cache, one token per step."""

    def __init__(self, model: str, device: str = "cpu", threads: int | None = None, heal: bool = True) -> None:
        import torch

        from engine.weights.load import load_ar_model

        super().__init__()
        self.heal = heal  # token healing, as the diffusion engine does it (DecodeOptions.heal)
        if threads:
            torch.set_num_threads(threads)
        # a plain Llama (SmolLM2 from `dlm-lsp base-model`) is a causal LM without FIM tokens: prefix-only
        self.model, self.tok, self.cfg = load_ar_model(model, device=device)
        if self.cfg.attention != "causal":
            raise SystemExit(
                f"--ar-model {model}: attention is {self.cfg.attention!r}, expected 'causal' "
                "(train it with --objective ar)"
            )

    def decode(self, hole: Hole, req: FillRequest) -> tuple[str, int, int]:
        ids, healed = fim_greedy(self.model, self.tok, req.prefix, req.suffix, req.mask_slots, heal=self.heal)
        text = self.tok.decode(ids)
        if healed:  # the first token re-typed the prefix's tail (it starts with it)
            text = text[len(healed) :]
        return text, len(ids) + 1, len(ids)  # one forward per token + the prompt's


class OracleFiller(Filler):
    """Decodes the true middle: the ceiling that context + post-processing leave a perfect model."""

    def decode(self, hole: Hole, req: FillRequest) -> tuple[str, int, int]:
        return hole.middle, 0, 0


def fim_greedy(
    model: Transformer,
    tok: TextTokenizer,
    prefix: str,
    suffix: str,
    max_tokens: int,
    context_tokens: int = 512,
    heal: bool = False,
) -> tuple[list[int], str]:
    """Returns (the middle's token ids, healed text) from greedy PSM decoding with a KV cache
    (engine.decode.autoregressive), stopping at end-of-text or padding. The context is cut like the
    diffusion canvas (engine.decode.sampler.Canvas.build): the suffix keeps at most a third of the room.
    With `heal`, the prefix's tail is re-typed as the diffusion engine does it (TextTokenizer.heal):
    the ids then start with a token that starts with the healed text."""
    from engine.decode.autoregressive import fim_prompt, greedy_decode
    from engine.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

    # without FIM tokens (a plain causal LM such as SmolLM2) the prompt is the prefix alone
    fim = None not in (tok.token_id(FIM_PREFIX), tok.token_id(FIM_SUFFIX), tok.token_id(FIM_MIDDLE))
    cfg = model.cfg
    # never past the twin's training window (the diffusion canvas is cut to its own the same way)
    context_tokens = min(context_tokens, cfg.context_len or cfg.max_seq_len, cfg.max_seq_len)
    p_ids, s_ids = tok.encode_batch([prefix, suffix])
    h = tok.heal(p_ids) if heal else None
    if h:
        p_ids, max_tokens = p_ids[: -h.k], max_tokens + 1
    room = max(0, context_tokens - max_tokens - 3)
    s_keep = min(len(s_ids), room // 3) if fim else 0
    p_keep = min(len(p_ids), room - s_keep)
    prompt = fim_prompt(p_ids[len(p_ids) - p_keep :], s_ids[:s_keep], tok)
    if not prompt:  # prefix-only at the top of a file (or all of it re-typed): start a document
        prompt = [cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_id]
    ids = greedy_decode(
        model, prompt, max_tokens, stop_ids=(cfg.eos_token_id, cfg.pad_token_id), heal=(h.first, h.then) if h else None
    ).ids
    return ids, h.text if h else ""


# ----------------------------------------------------------------------------- running


def load_files(
    source: str | None, limit_files: int | None, corpus_dir: str | None = None, heldout: str = "all"
) -> list[tuple[str, str]]:
    """(key, text) of the held-out files of the training split, of a built corpus's held-out side, or
    of every .py file under `source`."""
    if corpus_dir:
        from engine.train.corpus import built_files

        try:
            sides = built_files(corpus_dir)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from e
        picked = {"files": ["heldout"], "packages": ["heldout_packages"], "all": ["heldout", "heldout_packages"]}[
            heldout
        ]
        items = sorted(((f.key, f.path) for side in picked for f in sides[side]), key=lambda kv: kv[0])
    elif source:
        root = Path(source).resolve()
        if not root.is_dir():
            raise SystemExit(f"--source {source} is not a folder")
        paths = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
        items = [(f"{root.name}:{p.relative_to(root).as_posix()}", p) for p in paths]
    else:
        from engine.train.corpus import heldout_files

        items = [(f.key, f.path) for f in heldout_files()]
    out = []
    for key, path in items:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((key, text))
        if limit_files and len(out) >= limit_files:
            break
    return out


MIN_SHOWN_CHARS = 2  # a fill shorter than this (non-space) is not counted as shown


def _shown(text: str) -> bool:
    return len("".join(text.split())) >= MIN_SHOWN_CHARS


def _accepted(h: Hole, shown: str, replace_len: int) -> bool:
    ref = h.middle + h.suffix[:replace_len]
    return ref.startswith(shown.rstrip())


STRICT_MIN_CHARS = 3  # a strictly accepted fill has this many non-space characters and a letter or digit
STRICT_FLOOR = 0.40  # a kind passes when some gate that still shows a fill reaches this strict share


def substantial(text: str) -> bool:
    """True when a fill carries code worth a keystroke: a letter or digit and at least
    STRICT_MIN_CHARS non-space characters (a lone `""`, `(`, `:`, `if` or `x` is not)."""
    body = "".join(text.split())
    return len(body) >= STRICT_MIN_CHARS and any(c.isalnum() for c in body)


def strictly_accepted(h: Hole, shown: str, replace_len: int) -> bool:
    """True when the true text starts with the fill (_accepted) and the fill is substantial: the
    stricter rule of issue 38, since `accepted` also counts a closing bracket or a two-letter keyword
    that a user would have typed as fast as read."""
    return substantial(shown) and _accepted(h, shown, replace_len)


def _acceptance(holes: list[Hole], samples: list[Sample]) -> dict[str, Any]:
    """shown, accepted, accepted_chars, strict and strict_chars of the shown fills (after the gate)."""
    n = max(1, len(samples))
    shown_ok = [(h, s) for h, s in zip(holes, samples) if _shown(s.shown)]
    kept = [s.shown for h, s in shown_ok if _accepted(h, s.shown, s.replace_len)]
    strict = [s.shown for h, s in shown_ok if strictly_accepted(h, s.shown, s.replace_len)]
    return {
        "shown": round(len(shown_ok) / n, 4),
        "accepted": round(len(kept) / max(1, len(shown_ok)), 4),
        # what the user keeps, per hole: the characters of the accepted shown fills over every hole. A
        # share alone rewards showing less; this falls when fills are cut short or hidden needlessly
        "accepted_chars": round(sum(len(t.rstrip()) for t in kept) / n, 3),
        # the same two over the strictly accepted fills only (strictly_accepted)
        "strict": round(len(strict) / max(1, len(shown_ok)), 4),
        "strict_chars": round(sum(len(t.rstrip()) for t in strict) / n, 3),
    }


def overall(holes: list[Hole], samples: list[Sample]) -> dict[str, Any]:
    """The acceptance measures (_acceptance) and the gate curve over the holes of every kind together."""
    return {"holes": len(samples), **_acceptance(holes, samples), "curve": accept_curve(holes, samples, strict=True)}


def accept_curve(
    holes: list[Hole], samples: list[Sample], gates: list[float] | None = None, strict: bool = False
) -> list[dict[str, float]]:
    """(gate, shown, accepted, chars) for each confidence gate: the ungated fills whose confidence
    passes; `chars` is the accepted characters per hole (accepted_chars). With `strict`, each point
    also has `strict` and `strict_chars` (strictly_accepted; what pick_gate chooses by)."""
    gates = gates or [round(0.05 * i, 2) for i in range(21)]
    out = []
    n = max(1, len(samples))
    for g in gates:
        shown = acc = chars = strict_n = strict_chars = 0
        for h, s in zip(holes, samples):
            text = s.ungated if s.ungated is not None else s.shown
            if _shown(text) and s.confidence >= g:
                shown += 1
                replace_len = s.ungated_replace_len if s.ungated is not None else s.replace_len
                ok = _accepted(h, text, replace_len)
                acc += ok
                chars += ok * len(text.rstrip())
                sure = ok and substantial(text)
                strict_n += sure
                strict_chars += sure * len(text.rstrip())
        point = {
            "gate": g,
            "shown": round(shown / n, 4),
            "accepted": round(acc / max(1, shown), 4),
            "chars": round(chars / n, 3),
        }
        if strict:
            point["strict"] = round(strict_n / max(1, shown), 4)
            point["strict_chars"] = round(strict_chars / n, 3)
        out.append(point)
    return out


def pick_gate(curve: list[dict[str, float]], floor: float = STRICT_FLOOR) -> dict[str, Any]:
    """The gate of a kind's curve (accept_curve with strict) that keeps the most strictly accepted
    characters per hole, its point, and whether the kind passes the floor: strict >= `floor` at some
    gate that still shows a fill (`floor_gate`: the lowest such gate, None where none does;
    `floor_shown`: the share of holes that gate still shows, since a pass on a handful of fills is weak)."""
    showing = [p for p in curve if p["shown"] > 0]
    # max() keeps the first of equals: the lowest gate, which shows the most for the same characters
    best = max(showing or curve, key=lambda p: p["strict_chars"])
    reach = [p for p in showing if p["strict"] >= floor]
    return {
        "gate": best["gate"],
        **{k: best[k] for k in ("shown", "accepted", "strict", "strict_chars")},
        "floor": floor,
        "passes": bool(reach),
        "floor_gate": reach[0]["gate"] if reach else None,
        "floor_shown": reach[0]["shown"] if reach else 0.0,
        "best_strict": max((p["strict"] for p in showing), default=0.0),
    }


def gate_summary(res: dict[str, dict[str, Any]], floor: float = STRICT_FLOOR) -> dict[str, dict[str, Any]]:
    """pick_gate for each kind of one model's results (and "all", where there is one)."""
    return {k: pick_gate(r["curve"], floor) for k, r in res.items() if "curve" in r}


def gate_lines(label: str, gates: dict[str, dict[str, Any]]) -> list[str]:
    """One printed line per kind of gate_summary."""
    out = []
    for kind, g in gates.items():
        verdict = (
            f"pass from gate {g['floor_gate']:g} (shown {g['floor_shown']:.3f})"
            if g["passes"]
            else f"fail (best {g['best_strict']:.3f})"
        )
        out.append(
            f"[gates {label}] {kind:6s} best gate {g['gate']:g}: shown {g['shown']:.3f} accepted {g['accepted']:.3f} "
            f"strict {g['strict']:.3f} strict chars {g['strict_chars']:.2f}; strict >= {g['floor']:.2f}: {verdict}"
        )
    return out


def plot_curves(curves: dict[str, list[dict[str, float]]], png: str, gate: float | None = None) -> None:
    """accepted vs shown, one line per (model, kind), each point a confidence gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, pts in curves.items():
        pts = [p for p in pts if p["shown"] > 0]  # a gate that hides everything has no accepted share
        if not pts:
            continue
        (line,) = ax.plot([p["shown"] for p in pts], [p["accepted"] for p in pts], "o-", ms=3, label=name)
        if gate is not None:
            at = min(pts, key=lambda p: abs(p["gate"] - gate))
            ax.plot([at["shown"]], [at["accepted"]], "s", ms=8, color=line.get_color(), mfc="none")
    ax.set_xlabel("shown (share of holes with a fill)")
    ax.set_ylabel("accepted (share of shown fills the true text starts with)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no curve when every gate hid every fill (a tiny test model)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no fill shown at any gate", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("confidence gate: accepted vs shown" + (f" (square: gate {gate:g})" if gate is not None else ""))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def score(holes: list[Hole], samples: list[Sample]) -> dict[str, Any]:
    """Per-kind metrics of filled holes."""
    base: dict[str, int] = {}
    exact = sim = clean = clean_shown = dup = 0.0
    shown_n = 0
    kinds: dict[str, int] = {}
    for h, s in zip(holes, samples):
        if h.key not in base:
            base[h.key] = count_syntax_errors(h.text)
        # a fill that also replaces text after the cursor (re-typed closers) must equal middle + that text
        ref = h.middle + h.suffix[: s.replace_len]
        exact += exact_match(s.shown, ref)
        sim += edit_similarity(normalize(s.shown), normalize(ref))
        clean += syntax_clean(h, s.raw, base[h.key])
        if s.shown.strip():
            shown_n += 1
            accepted = h.text[: h.a] + s.shown + h.text[h.b + s.replace_len :]
            clean_shown += count_syntax_errors(accepted) <= base[h.key]
        dup += repeats_suffix(s.raw, h.suffix)
        kinds[s.server_kind] = kinds.get(s.server_kind, 0) + 1
    n = max(1, len(samples))
    ms = [s.ms for s in samples]
    return {
        "holes": len(samples),
        "exact": round(exact / n, 4),
        "edit_sim": round(sim / n, 4),
        "syntax_clean": round(clean / n, 4),
        "dup_suffix": round(dup / n, 4),
        "p50_ms": round(percentile(ms, 50), 1),
        "p95_ms": round(percentile(ms, 95), 1),
        # shown, accepted, accepted_chars (kept chars), strict, strict_chars
        **_acceptance(holes, samples),
        # extras: syntax of the non-empty shown fills once accepted, decoding effort, share of holes
        # where nothing is shown, and what the server's context called the hole
        "syntax_clean_shown": round(clean_shown / max(1, shown_n), 4),
        "engine_p50_ms": round(percentile([s.engine_ms for s in samples], 50), 1),
        "steps_mean": round(statistics.fmean([s.steps for s in samples]), 2) if samples else 0.0,
        "tokens_mean": round(statistics.fmean([s.tokens for s in samples]), 2) if samples else 0.0,
        "empty": round(sum(1 for s in samples if not s.shown.strip()) / n, 4),
        "server_kinds": dict(sorted(kinds.items())),
    }


def evaluate(
    filler: Filler,
    holes: dict[str, list[Hole]],
    label: str = "",
    samples_out: IO[str] | None = None,
    keep: list[Sample] | None = None,
) -> dict[str, dict[str, Any]]:
    """Fills every hole with `filler` and returns {kind: metrics}, and with more than one kind "all":
    the acceptance measures over every hole (overall); `keep` collects the Samples."""
    results = {}
    every: tuple[list[Hole], list[Sample]] = ([], [])
    total = sum(len(v) for v in holes.values())
    done, t0 = 0, time.time()
    for kind, hs in holes.items():
        samples = []
        for h in hs:
            s = filler(h)
            samples.append(s)
            if keep is not None:
                keep.append(s)
            done += 1
            if samples_out is not None:
                ungated = s.ungated if s.ungated is not None else s.shown
                samples_out.write(
                    json.dumps(
                        {
                            "model": label,
                            **h.describe(),
                            "raw": s.raw,
                            "shown": s.shown,
                            "ms": round(s.ms, 1),
                            "server_kind": s.server_kind,
                            "ungated": ungated,
                            "confidence": round(s.raw_confidence, 6),
                            "score": round(s.confidence, 6),
                            "features": s.features,
                            # what `dlm-lsp calibrate` fits: would the user keep the ungated fill
                            "accepted": _accepted(h, ungated, s.ungated_replace_len) if _shown(ungated) else None,
                            # the shown fill as scored (score(): exact; accepted_chars), for paired comparisons
                            # of two runs on the same holes (dlm_lsp/measure/paired.py)
                            "exact": exact_match(s.shown, h.middle + h.suffix[: s.replace_len]),
                            "kept_chars": len(s.shown.rstrip())
                            if _shown(s.shown) and _accepted(h, s.shown, s.replace_len)
                            else 0,
                            # the shown fill strictly accepted (score(): strict; False where nothing is shown)
                            "strict": _shown(s.shown) and strictly_accepted(h, s.shown, s.replace_len),
                        }
                    )
                    + "\n"
                )
            if done % 50 == 0 or done == total:
                print(
                    f"[eval{' ' + label if label else ''}] {done}/{total} holes, {time.time() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        results[kind] = score(hs, samples)
        results[kind]["curve"] = accept_curve(hs, samples, strict=True)
        every[0].extend(hs)
        every[1].extend(samples)
    if len(holes) > 1:
        results["all"] = overall(*every)
    return results


def _chars(r: dict[str, Any], key: str = "accepted_chars") -> str:
    return f"{r[key]:.2f}" if key in r else "-"


def _share(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.3f}" if key in r else "-"


def markdown_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """A Markdown table: one row per (model, kind); the "all" of evaluate() is in the JSON only."""
    rows = [
        "| model | kind | holes | exact | edit sim | syntax clean | shown | accepted | kept chars | p50 ms | p95 ms "
        "| strict | strict chars |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, res in results.items():
        for kind in KINDS:
            if kind not in res:
                continue
            r = res[kind]
            rows.append(
                f"| {label} | {kind} | {r['holes']} | {r['exact']:.3f} | {r['edit_sim']:.3f} | "
                f"{r['syntax_clean']:.3f} | {r['shown']:.3f} | {r['accepted']:.3f} | {_chars(r)} | "
                f"{r['p50_ms']:.0f} | {r['p95_ms']:.0f} | {_share(r, 'strict')} | {_chars(r, 'strict_chars')} |"
            )
    return "\n".join(rows)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default=None, help="evaluate on the .py files of DIR (default: the held-out split)")
    p.add_argument("--corpus", default=None, help="a corpus built by `dlm-lsp corpus`: take its held-out side")
    p.add_argument(
        "--heldout",
        choices=["files", "packages", "all"],
        default="all",
        help="with --corpus: held-out files, whole held-out packages, or both",
    )
    p.add_argument(
        "--curve", default=None, metavar="PNG", help="write the accepted-vs-shown curve over the confidence gate"
    )
    p.add_argument("--model", default=None, help="diffusion checkpoint folder (default: models/default)")
    p.add_argument("--ar-model", default=None, help="also evaluate this autoregressive FIM twin on the same holes")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write metrics as JSON")
    p.add_argument("--md", dest="md_out", default=None, metavar="OUT", help="write the Markdown table")
    p.add_argument("--samples", default=None, metavar="OUT", help="write every hole and fill as JSON lines")
    p.add_argument("--per-kind", type=int, default=300, help="holes per kind (default 300)")
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        metavar="N",
        help="cross-file context: give each fill the N nearest evaluated files of its folder as other open documents",
    )
    p.add_argument(
        "--retrieve",
        default=None,
        choices=("neighbours", "package"),
        help="cross-file context as the snippets most like the cursor's code (dlm_lsp.fill.retrieval) "
        "from the --neighbours files or from the package's other evaluated files",
    )
    p.add_argument(
        "--kinds", default=",".join(KINDS), help="comma-separated hole kinds; `edit` alone: the next-edit eval"
    )
    p.add_argument("--limit-files", type=int, default=None, help="use only the first N files (by key)")
    p.add_argument("--seed", type=int, default=0, help="hole-cutting seed")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also score the true middle through the same post-processing (the ceiling)",
    )
    p.add_argument(
        "--oracle-only",
        action="store_true",
        help="score only the true middle (no model is loaded): the post-processing ceiling",
    )
    p.add_argument(
        "--decode",
        default=None,
        metavar="JSON",
        help="""override the server's decoding options, e.g. '{"pad_left": false}'""",
    )
    p.add_argument(
        "--min-confidence",
        type=float,
        default=None,
        help="hide fills the engine is less sure of (default: the server's minConfidence)",
    )
    p.add_argument(
        "--raw-gate",
        action="store_true",
        help="gate on the engine's raw confidence even where the model has a calibrated gate "
        '(serving.json "calibrator"): the calibrator off, for comparison',
    )
    p.add_argument(
        "--reuse-typing",
        type=int,
        default=0,
        metavar="N",
        help="also fill each hole after typing its last N characters one at a time with approximate "
        "context reuse on (DecodeOptions.reuse; reuse_budget from --decode): quality with reuse on vs off",
    )
    p.add_argument(
        "--budget-ms",
        type=float,
        default=None,
        help="give each fill the server's deadline (default: none, so results do not depend on load)",
    )
    from dlm_lsp.measure.edit_eval import add_edit_eval_args

    add_edit_eval_args(p)  # --kinds edit: dlm_lsp/measure/edit_eval.py


def run_eval(args: argparse.Namespace) -> int:
    t_start = time.time()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if "edit" in kinds:  # next edits on edit cases, not fills on holes
        from dlm_lsp.measure.edit_eval import run_edit_eval

        return run_edit_eval(args)
    files = load_files(args.source, args.limit_files, getattr(args, "corpus", None), getattr(args, "heldout", "all"))
    if not files:
        print("no Python files to cut holes from", file=sys.stderr)
        return 1
    holes = cut_holes(files, args.per_kind, args.seed, kinds)
    print(
        f"[eval] {len(files)} files, holes: " + ", ".join(f"{k} {len(v)}" for k, v in holes.items()),
        file=sys.stderr,
        flush=True,
    )

    samples_out = open(args.samples, "w") if args.samples else None
    if getattr(args, "oracle_only", False):
        try:
            oracle = OracleFiller()
            results = {"oracle": evaluate(oracle, holes, "oracle", samples_out)}
        finally:
            if samples_out is not None:
                samples_out.close()
        table = markdown_table(results)
        print(table)
        out: dict[str, Any] = dict(results["oracle"])
        out["gates"] = _print_gates(results)["oracle"]
        out["meta"] = {
            "oracle_only": True,
            "source": _source_name(args),
            "files": len(files),
            "seed": args.seed,
            "per_kind": args.per_kind,
            "counts": {k: len(v) for k, v in holes.items()},
            "postprocess": oracle.post_name,
            "elapsed_s": round(time.time() - t_start, 1),
        }
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
        if args.md_out:
            Path(args.md_out).write_text(table + "\n")
        return 0
    try:
        from dlm_lsp.options import InitializationOptions
        from engine.api import decode_options, with_model_defaults

        try:
            decode = decode_options(args.decode)
        except ValueError as e:
            print(f"eval: {e}", file=sys.stderr)
            return 2
        dlm = DiffusionFiller(
            args.model, device=args.device, threads=args.threads, budget_ms=args.budget_ms, options=decode
        )
        if not getattr(args, "raw_gate", False):  # the model's calibrated gate, as the server applies it
            from dlm_lsp.fill.gate import Calibrator

            dlm.calibrator = Calibrator.from_json(dlm.service.serving.get("calibrator"))
        # the server's gate: the user's minConfidence (here --min-confidence), else the model's own
        default_gate = InitializationOptions().min_confidence
        dlm.min_confidence = (
            args.min_confidence
            if args.min_confidence is not None
            else default_gate
            if default_gate is not None
            else dlm.service.serving.get("min_confidence", 0.0)
        )
        Filler.neighbours = Filler.snippets = None  # nothing from an earlier run in this process
        Filler.workspace = False
        if getattr(args, "neighbours", 0):  # cross-file context: siblings as the other open documents
            from dlm_lsp.fill.context import neighbour_text

            texts = dict(files)
            sib = sibling_files(texts, args.neighbours)
            Filler.neighbours = {k: neighbour_text([texts[o] for o in sib.get(k, [])]) for k in texts}
        if getattr(args, "retrieve", None):
            Filler.snippets = retrieval_fn(dict(files), args.retrieve, args.neighbours)
        if getattr(args, "retrieve", None) == "package":  # the workspace's n-gram: the package is the workspace
            workspace_memories(dict(files), dlm.service)
            Filler.workspace = True
        plain: list[Sample] = []
        results = {"diffusion": evaluate(dlm, holes, "diffusion", samples_out, keep=plain)}
        typed = None
        if getattr(args, "reuse_typing", 0) > 0:
            typed = TypedReuseFiller(dlm, args.reuse_typing)
            reused: list[Sample] = []
            results["diffusion+reuse"] = evaluate(typed, holes, "diffusion+reuse", samples_out, keep=reused)
            typed.same = (
                sum(a.raw == b.raw for a, b in zip(plain, reused)) / max(1, len(reused)),
                sum(a.shown == b.shown for a, b in zip(plain, reused)) / max(1, len(reused)),
            )
        ar = None
        if args.ar_model:
            ar = AutoregressiveFiller(args.ar_model, device=args.device, threads=args.threads, heal=decode.heal)
            results["autoregressive"] = evaluate(ar, holes, "autoregressive", samples_out)
        if args.oracle:
            results["oracle"] = evaluate(OracleFiller(), holes, "oracle", samples_out)
    finally:
        if samples_out is not None:
            samples_out.close()

    from dlm_lsp.fill.context import MASK_SLOTS
    from engine.api import KIND_DECODE_KEYS

    out = dict(results["diffusion"])
    out["meta"] = {
        "model": str(args.model or "default"),
        "model_path": _resolved(args.model),
        "source": _source_name(args),
        "files": len(files),
        "limit_files": args.limit_files,
        "neighbours": getattr(args, "neighbours", 0),
        "retrieve": getattr(args, "retrieve", None),
        "workspace_ngram_memory": Filler.workspace,  # the package counted for DecodeOptions.workspace_ngram
        "seed": args.seed,
        "per_kind": args.per_kind,
        "counts": {k: len(v) for k, v in holes.items()},
        # as the engine ran it: fields left at None take the model's serving.json "decode"
        "decode": dataclasses.asdict(with_model_defaults(dlm.options, dlm.service.serving.get("decode", {}))),
        # per hole kind where the model's setting differs (serving.json "ngram_kinds", "local_ngram_kinds"; FillJob.kind)
        "decode_by_kind": {
            k: dataclasses.asdict(with_model_defaults(dlm.options, dlm.service.serving.get("decode", {}), k))
            for k in sorted(
                {k for key in KIND_DECODE_KEYS for k in dlm.service.serving.get("decode", {}).get(f"{key}_kinds", {})}
            )
        },
        "mask_slots": dict(MASK_SLOTS),
        "context": "dlm_lsp.fill.context.build_request",
        "postprocess": dlm.post_name,
        "budget_ms": args.budget_ms,
        "min_confidence": dlm.min_confidence,
        # the gate compared the calibrated P(accepted) (serving.json "calibrator") or the raw confidence
        "gate_on": "calibrated" if dlm.calibrator is not None else "confidence",
        "device": args.device,
        "threads": args.threads,
        "elapsed_s": round(time.time() - t_start, 1),
    }
    table = markdown_table(results)
    print(table)
    gates = _print_gates(results)
    out["gates"] = gates["diffusion"]
    if typed is not None:
        out["reuse"] = {**results["diffusion+reuse"], **typed.summary(), "gates": gates["diffusion+reuse"]}
    if ar is not None:
        out["ar"] = {
            **results["autoregressive"],
            "model": str(args.ar_model),
            "decode": "greedy FIM PSM, KV cache",
            "gates": gates["autoregressive"],
        }
    if "oracle" in results:
        out["oracle"] = {**results["oracle"], "gates": gates["oracle"]}
    if getattr(args, "curve", None):
        curves = {
            f"{label} {kind}": r["curve"]
            for label, res in results.items()
            if label != "oracle"
            for kind, r in res.items()
            if kind in KINDS  # not evaluate()'s "all"
        }
        plot_curves(curves, args.curve, gate=dlm.min_confidence if isinstance(dlm.min_confidence, float) else None)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    if args.md_out:
        Path(args.md_out).write_text(table + "\n")
    return 0


def _print_gates(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """gate_summary of each model's results, each kind's line printed under the table."""
    gates = {label: gate_summary(res) for label, res in results.items()}
    for label, g in gates.items():
        for line in gate_lines(label, g):
            print(line)
    return gates


def _source_name(args: argparse.Namespace) -> str:
    if getattr(args, "corpus", None):
        return f"corpus {args.corpus} held-out {args.heldout}"
    return args.source or "held-out split (engine.train.corpus.heldout_files)"


def _resolved(model: str | None) -> str:
    try:
        from engine.weights.checkpoint import resolve_model_path

        return str(resolve_model_path(model))
    except Exception as e:  # noqa: BLE001 - only for the record
        return f"unresolved: {e}"
