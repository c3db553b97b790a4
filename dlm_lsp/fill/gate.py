"""The calibrated gate: the probability that a user accepts a fill, from what the server knows once
the fill is post-processed, instead of the engine's raw confidence alone.

The engine's confidence (Fill.confidence, the geometric mean of the committed tokens' probabilities)
ranks fills poorly on its own: a long fill copied from a line elsewhere in the file is often right at
a modest confidence, and two confident characters after `(` are often wrong. `Calibrator` is a
logistic regression over a few features of the request and the finished text (`features`); its
output replaces the raw confidence at the gate (postprocess.finish), so the model's `min_confidence`
reads as "show a fill when P(accepted) >= gate". It is fitted (`fit`, `dlm-lsp calibrate`) on the
samples `dlm-lsp eval --samples` writes, which carry each fill's features and whether the true text
starts with it (`accepted`, as the eval counts it), and stored in the model's serving.json under
"calibrator". A model without one gates on the raw confidence as before.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

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
    "kind_args", "kind_middle", "kind_block",  # the server's hole kind (line is the base)
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


def features(req, text: str, confidence: float, replace_len: int = 0) -> list[float]:
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
        float(req.hole_kind == "args"), float(req.hole_kind == "middle"), float(req.hole_kind == "block"),
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

    def score(self, req, text: str, confidence: float, replace_len: int = 0) -> float:
        x = dict(zip(FEATURES, features(req, text, confidence, replace_len)))
        return _sigmoid(self.bias + sum(w * x[n] for n, w in zip(self.names, self.weights)))

    def to_json(self) -> dict:
        out = {"features": list(self.names), "weights": [round(w, 6) for w in self.weights], "bias": round(self.bias, 6)}
        if self.fit_info:
            out["fit"] = self.fit_info
        return out

    @classmethod
    def from_json(cls, raw) -> "Calibrator | None":
        """The calibrator stored in serving.json, or None when it is absent or malformed (unknown
        feature names, non-numbers, lengths that differ): a model then gates on raw confidence."""
        if not isinstance(raw, dict):
            return None
        names, weights, bias = raw.get("features"), raw.get("weights"), raw.get("bias")
        if not (isinstance(names, list) and isinstance(weights, list) and len(names) == len(weights) and names):
            return None
        if not all(isinstance(n, str) and n in FEATURES for n in names) or len(set(names)) != len(names):
            return None
        nums = [*weights, bias]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in nums):
            return None
        return cls(tuple(names), tuple(float(w) for w in weights), float(bias),
                   raw.get("fit") if isinstance(raw.get("fit"), dict) else None)


def fit(rows: list[list[float]], labels: list[int], l2: float = 1.0, iters: int = 50) -> tuple[list[float], float]:
    """Logistic regression by Newton's method with an L2 penalty `l2` on the weights (not the bias):
    returns (weights, bias). Features are standardized for the solve and mapped back."""
    import numpy as np

    X = np.asarray(rows, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if X.ndim != 2 or len(X) != len(y) or len(y) == 0:
        raise ValueError("fit needs one label per feature row")
    mu, sd = X.mean(0), X.std(0)
    sd[sd < 1e-9] = 1.0  # a constant feature keeps weight 0 under the penalty
    Z = np.hstack([np.ones((len(X), 1)), (X - mu) / sd])
    w = np.zeros(Z.shape[1])
    pen = np.full(Z.shape[1], l2)
    pen[0] = 0.0
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(Z @ w, -30, 30)))
        grad = Z.T @ (p - y) + pen * w
        hess = (Z * (p * (1 - p))[:, None]).T @ Z + np.diag(pen) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    weights = w[1:] / sd
    bias = w[0] - float((w[1:] * mu / sd).sum())
    return [float(v) for v in weights], float(bias)


def _samples(paths: list[str], model: str | None = None, kinds: tuple[str, ...] | None = None):
    """(path, sample) of every hole in `dlm-lsp eval --samples` files, of the eval label `model`
    and the hole `kinds` when given."""
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            s = json.loads(line)
            if (model is not None and s.get("model") != model) or (kinds and s.get("kind") not in kinds):
                continue
            yield path, s


def _hole_id(s: dict) -> tuple:
    return s.get("key"), s.get("line"), s.get("col")


def _has_fill(s: dict) -> bool:
    """A fill the calibrator scores: features computed and its acceptance known (>= 2 characters)."""
    return s.get("features") is not None and s.get("accepted") is not None


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-max(-700.0, z)))


def hole_ids(paths: list[str]) -> set[tuple]:
    """(key, line, col) of every hole in `dlm-lsp eval --samples` files."""
    return {_hole_id(s) for _, s in _samples(paths)}


def load_samples(paths: list[str], model: str | None = None, kinds: tuple[str, ...] | None = None,
                 exclude: set[tuple] | None = None):
    """(feature rows, accepted labels) of the shown-ungated fills in `dlm-lsp eval --samples` files,
    leaving out the holes in `exclude` ((key, line, col): the holes the gate will be judged on)."""
    rows, labels = [], []
    for path, s in _samples(paths, model, kinds):
        if (exclude and _hole_id(s) in exclude) or not _has_fill(s):
            continue
        if s.get("feature_names") and tuple(s["feature_names"]) != FEATURES:
            raise SystemExit(f"{path}: samples from another feature set; re-run dlm-lsp eval --samples")
        rows.append(s["features"])
        labels.append(int(bool(s["accepted"])))
    return rows, labels


def _fill(s: dict, score: float) -> tuple:
    """(raw confidence, calibrated score, accepted, non-space characters) of a sample's fill."""
    chars = round(math.expm1(s["features"][FEATURES.index("log_chars")]))
    return float(s["confidence"]), score, bool(s["accepted"]), chars


def _at_shares(fills: list[tuple], holes: int, shares, per_shown: bool) -> list[dict]:
    """fills: _fill tuples. Per shown share: the accepted share of the top-ranked fills under each
    gate, and the characters they give: per shown fill (`per_shown`, key `<gate>_chars_per_shown`)
    or per accepted fill (key `<gate>_chars`; a gate that prefers short fills is accepted more often)."""
    out = []
    for share in shares:
        k = int(round(share * holes))
        if k == 0 or k > len(fills):
            continue
        row = {"shown": share}
        for name, i in (("confidence", 0), ("calibrated", 1)):
            top = sorted(fills, key=lambda f: -f[i])[:k]
            accepted = sum(f[2] for f in top)
            chars = sum(f[3] for f in top if f[2])
            row[name] = round(accepted / k, 4)
            if per_shown:
                row[f"{name}_chars_per_shown"] = round(chars / k, 2)
            else:
                row[f"{name}_chars"] = round(chars / max(1, accepted), 1)
        out.append(row)
    return out


def judge(paths: list[str], cal: Calibrator, model: str | None = None, kinds: tuple[str, ...] | None = None,
          shares=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6)) -> dict:
    """The raw confidence and the calibrated score as gates on the same filled holes (eval
    --samples files, every hole counted in `shown`'s denominator): accepted among the fills each
    ranks highest when the top `share` of holes are shown, and each one's curve over gates."""
    holes, fills = 0, []
    for _, s in _samples(paths, model, kinds):
        holes += 1
        if _has_fill(s):
            x = dict(zip(FEATURES, s["features"]))
            fills.append(_fill(s, _sigmoid(cal.bias + sum(w * x[n] for n, w in zip(cal.names, cal.weights)))))
    out: dict = {"holes": holes, "fills": len(fills), "accepted_ungated": round(sum(f[2] for f in fills) / max(1, len(fills)), 4),
                 "at_shown": _at_shares(fills, holes, shares, per_shown=False), "curves": {}}
    for name, i in (("confidence", 0), ("calibrated", 1)):
        pts = []
        for g in [round(0.05 * j, 2) for j in range(21)]:
            sel = [f for f in fills if f[i] >= g]
            pts.append({"gate": g, "shown": round(len(sel) / max(1, holes), 4),
                        "accepted": round(sum(f[2] for f in sel) / max(1, len(sel)), 4)})
        out["curves"][name] = pts
    return out


def cross_validate(paths: list[str], names: tuple[str, ...], l2: float, folds: int, model: str | None = None,
                   kinds: tuple[str, ...] | None = None, shares=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6)) -> dict:
    """Fits on all but one fold of files (sha256 of the hole's file key) and scores the held-out
    fold, for every fold: the raw and the calibrated gate compared out of sample on the fit's own
    samples (how a choice of features is made without the holes it will be judged on)."""
    import hashlib

    per: list[tuple[int, list[float], dict]] = []  # (fold, the fitted features, sample)
    holes = 0
    for _, s in _samples(paths, model, kinds):
        holes += 1
        if _has_fill(s):
            fold = int(hashlib.sha256(str(s.get("key")).encode()).hexdigest()[:8], 16) % folds
            x = dict(zip(FEATURES, s["features"]))
            per.append((fold, [x[n] for n in names], s))
    fills = []
    for k in range(folds):
        train = [p for p in per if p[0] != k]
        labels = [int(bool(p[2]["accepted"])) for p in train]
        if len(set(labels)) < 2:
            raise SystemExit("calibrate --folds: a fold's training side has one class only")
        w, b = fit([p[1] for p in train], labels, l2)
        fills += [_fill(p[2], _sigmoid(b + sum(wi * xi for wi, xi in zip(w, p[1])))) for p in per if p[0] == k]
    return {"folds": folds, "features": list(names), "holes": holes, "fills": len(fills),
            "at_shown": _at_shares(fills, holes, shares, per_shown=True)}


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("samples", nargs="+", help="JSONL written by dlm-lsp eval --samples (holes not scored later)")
    p.add_argument("--label", default="diffusion", help="the eval's model label to fit on (default diffusion)")
    p.add_argument("--kinds", default=None, help="comma-separated hole kinds to fit on (default all)")
    p.add_argument("--exclude", nargs="*", default=[], metavar="SAMPLES",
                   help="leave out the holes of these eval --samples files (the ones the gate is judged on)")
    p.add_argument("--drop", default=",".join(DROP),
                   help=f"comma-separated FEATURES not to fit (default {','.join(DROP)}; '' fits all)")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the standardized weights")
    p.add_argument("--write", default=None, metavar="SERVING_JSON",
                   help="store the calibrator in this serving.json (its other keys kept)")
    p.add_argument("--note", default=None, help="a line stored with the fit (where the samples came from)")
    p.add_argument("--judge", nargs="*", default=[], metavar="SAMPLES",
                   help="compare the raw and the calibrated gate on these eval --samples files (other holes)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the fit and the judgement as JSON")
    p.add_argument("--folds", type=int, default=0, metavar="K",
                   help="also cross-validate on the samples themselves, K folds of files: raw vs calibrated out of sample")


def run_calibrate(args: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else None
    exclude = hole_ids(args.exclude) if args.exclude else None
    rows, labels = load_samples(args.samples, args.label, kinds, exclude)
    if len(rows) < 20 or len(set(labels)) < 2:
        print(f"calibrate: {len(rows)} shown fills with {sum(labels)} accepted: too few to fit", file=sys.stderr)
        return 1
    drop = {d.strip() for d in args.drop.split(",") if d.strip()}
    unknown = drop - set(FEATURES)
    if unknown:
        print(f"calibrate: unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}", file=sys.stderr)
        return 2
    keep = [i for i, n in enumerate(FEATURES) if n not in drop]
    weights, bias = fit([[r[i] for i in keep] for r in rows], labels, args.l2)
    names = tuple(FEATURES[i] for i in keep)
    info = {"fills": len(rows), "accepted": sum(labels), "l2": args.l2,
            "samples": [Path(p).name for p in args.samples]}
    if args.exclude:
        info["excluded_holes_of"] = [Path(p).name for p in args.exclude]
    if args.note:
        info["note"] = args.note
    cal = Calibrator(names, tuple(weights), bias, info)
    for name, w in zip(names, weights):
        print(f"  {name:18s} {w:+.3f}")
    print(f"  {'bias':18s} {bias:+.3f}   ({len(rows)} shown fills, {sum(labels)} accepted)")
    report = {"calibrator": cal.to_json()}
    if args.folds >= 2:
        report["cross_validation"] = cv = cross_validate(args.samples, names, args.l2, args.folds, args.label, kinds)
        print(f"cross-validated over {cv['folds']} folds of files ({cv['holes']} holes, {cv['fills']} with a fill):")
        print("  shown   accepted (raw, calibrated)   accepted characters per shown fill (raw, calibrated)")
        for row in cv["at_shown"]:
            print(f"  {row['shown']:.2f}    {row['confidence']:.3f}, {row['calibrated']:.3f}"
                  f"                 {row['confidence_chars_per_shown']:.2f}, {row['calibrated_chars_per_shown']:.2f}")
    if args.judge:
        report["judge"] = j = judge(args.judge, cal, args.label, kinds)
        print(f"judged on {j['holes']} holes ({j['fills']} with a fill, {j['accepted_ungated']:.3f} of them accepted):")
        print("  shown   accepted (raw confidence)   accepted (calibrated)   characters per accepted fill (raw, calibrated)")
        for row in j["at_shown"]:
            print(f"  {row['shown']:.2f}    {row['confidence']:.3f}                     {row['calibrated']:.3f}"
                  f"                   {row['confidence_chars']:.1f}, {row['calibrated_chars']:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.write:
        path = Path(args.write)
        raw = json.loads(path.read_text()) if path.is_file() else {}
        raw["calibrator"] = cal.to_json()
        path.write_text(json.dumps(raw, indent=2) + "\n")
        print(f"calibrator written to {path}")
    else:
        print(json.dumps(cal.to_json()))
    return 0
