"""The calibrated gate: the probability that a user accepts a fill, from what the server knows once
the fill is post-processed, instead of the engine's raw confidence alone.

The engine's confidence (Fill.confidence, the geometric mean of the committed tokens' probabilities)
ranks fills poorly on its own: a long fill copied from a line elsewhere in the file is often right at
a modest confidence, and two confident characters after `(` are often wrong. `Calibrator` is a
logistic regression over a few features of the request and the finished text (`features`); its
output replaces the raw confidence at the gate (postprocess.finish), so the model's `min_confidence`
reads as "show a fill when P(accepted) >= gate". It is fitted (`dlm-lsp calibrate`,
dlm_lsp/measure/calibrate.py) on the samples `dlm-lsp eval --samples` writes, which carry each fill's
features and whether the true text starts with it (`accepted`, as the eval counts it), and stored in
the model's serving.json under "calibrator". A model without one gates on the raw confidence as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from dlm_lsp.fill.context import FillRequest


def kind_gate(raw: object, kind: str) -> float:
    """The gate on one hole kind's shown fills from a model's `min_confidence` (serving.json, reported
    by the engine as `gate`): a number for every kind, or {kind: number} per hole kind (a kind it
    does not name: 0). A gate of 1 or more shows nothing of that kind: no score reaches it (the model's
    fills of that kind are hidden by default; the user's minConfidence overrides every kind)."""
    if isinstance(raw, dict):
        raw = raw.get(kind, 0.0)
    if not isinstance(raw, (int, float)) or isinstance(raw, bool):
        return 0.0
    return math.inf if raw >= 1.0 else float(raw)  # a score of exactly 1.0 (all-certain tokens) stays hidden too


FEATURES = (
    "logit_confidence",  # log(c / (1 - c)) of the engine's confidence, c clipped to [1e-4, 1 - 1e-4]
    "log_chars",  # log(1 + non-space characters of the fill); not fitted by default (DROP)
    "log_typed",  # log(1 + non-space characters typed on the line before the cursor)
    "in_context",  # the fill (>= 4 non-space characters) occurs verbatim in the context or far text
    "line_in_context",  # the cursor line up to the fill's end occurs elsewhere in the context
    "after_dot",  # the line before the cursor ends with "."
    "after_open",  # ... with an opening bracket or a comma
    "after_word",  # ... with a letter, digit or "_"
    "after_space",  # ... with a space or "=" (an operator or keyword position)
    "line_start",  # nothing but indentation before the cursor
    "kind_args",
    "kind_middle",
    "kind_block",  # the server's hole kind (line is the base)
    "code_after",  # code after the cursor on its line
    "replaces",  # the fill also re-types characters after the cursor
    "ends_colon",  # the fill ends with ":" (opens a block)
    "multi_line",  # the fill spans lines
)


# Features `dlm-lsp calibrate` leaves out unless told otherwise. A fill's length predicts acceptance
# (the true text starts with a short fill more often), so a gate that prefers short fills is accepted
# more often for less. On the default model's 2,000 seed-1 line holes, cross-validated over 2 folds
# of files (`--folds 2`), at 20% of holes shown: with log_chars accepted 0.632 but 3.83 accepted
# characters per shown fill, fewer than the raw confidence's 4.28 (accepted 0.477); without it 0.530
# and 4.97, ahead of the raw gate on both at every share from 20% to 60% (docs/MODEL.md).
DROP = ("log_chars",)


def _clip(c: float) -> float:
    return min(max(float(c), 1e-4), 1 - 1e-4)


def features(req: FillRequest, text: str, confidence: float, replace_len: int = 0) -> list[float]:
    """The FEATURES of a finished fill `text` for request `req` (context.FillRequest), in order."""
    c = _clip(confidence)
    before = req.line_before
    tail = before.rstrip(" \t")
    last = before[-1:] if before else ""
    compact = text.strip()
    chars = len("".join(text.split()))
    # where the fill could have been copied from: the window and the far text, without the cursor
    # line's own start (which trivially contains the typed part)
    cut = len(req.prefix) - len(before)
    context = req.prefix[: max(0, cut)] + "\n" + req.suffix + "\n" + (getattr(req, "far", "") or "")
    first = text.split("\n", 1)[0]
    line = (before.lstrip() + first).strip()
    return [
        math.log(c / (1 - c)),
        math.log1p(chars),
        math.log1p(len("".join(before.split()))),
        float(chars >= 4 and compact in context),
        float(len(line) >= 8 and line in context),
        float(tail.endswith(".")),
        float(bool(tail) and tail[-1] in "([{,"),
        float(bool(last) and (last.isalnum() or last == "_")),
        float(last in (" ", "\t") or tail.endswith("=")),
        float(not before.strip()),
        float(req.hole_kind == "args"),
        float(req.hole_kind == "middle"),
        float(req.hole_kind == "block"),
        float(bool(req.line_after.strip())),
        float(replace_len > 0),
        float(text.rstrip().endswith(":")),
        float("\n" in text.strip("\n")),
    ]


@dataclass
class Calibrator:
    """P(accepted) = sigmoid(bias + weights . features(...)); `names` are the FEATURES it was fitted on."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    bias: float
    fit_info: dict | None = None

    def score(self, req: FillRequest, text: str, confidence: float, replace_len: int = 0) -> float:
        x = dict(zip(FEATURES, features(req, text, confidence, replace_len)))
        return _sigmoid(self.bias + sum(w * x[n] for n, w in zip(self.names, self.weights)))

    def to_json(self) -> dict:
        out = {
            "features": list(self.names),
            "weights": [round(w, 6) for w in self.weights],
            "bias": round(self.bias, 6),
        }
        if self.fit_info:
            out["fit"] = self.fit_info
        return out

    @classmethod
    def from_json(cls, raw: object) -> Calibrator | None:
        """The calibrator stored in serving.json, or None when it is absent or malformed (unknown
        feature names, non-numbers, lengths that differ): a model then gates on raw confidence."""
        if not isinstance(raw, dict):
            return None
        names, weights, bias = raw.get("features"), raw.get("weights"), raw.get("bias")
        if not (isinstance(names, list) and isinstance(weights, list) and len(names) == len(weights) and names):
            return None
        if not all(isinstance(n, str) and n in FEATURES for n in names) or len(set(names)) != len(names):
            return None
        if not (all(_finite(w) for w in weights) and _finite(bias)):
            return None
        return cls(
            tuple(names),
            tuple(float(w) for w in weights),
            float(bias),
            raw.get("fit") if isinstance(raw.get("fit"), dict) else None,
        )


def _finite(v: object) -> TypeGuard[float]:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-max(-700.0, z)))
