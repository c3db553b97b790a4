"""`dlm-lsp calibrate`: fitting and judging the calibrated gate (dlm_lsp/fill/gate.py).

`fit` is a logistic regression over gate.FEATURES; it is fitted on the samples `dlm-lsp eval --samples`
writes (`load_samples`: each fill's features and whether the true text starts with it), judged
against the raw confidence on other holes (`judge`) or out of sample on its own (`cross_validate`),
and stored in the model's serving.json under "calibrator", which gate.Calibrator reads at serving time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dlm_lsp.fill.gate import DROP, FEATURES, Calibrator, _sigmoid


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


def _samples(
    paths: list[str], model: str | None = None, kinds: tuple[str, ...] | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
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


def _hole_id(s: dict[str, Any]) -> tuple[Any, ...]:
    return s.get("key"), s.get("line"), s.get("col")


def _has_fill(s: dict[str, Any]) -> bool:
    """A fill the calibrator scores: features computed and its acceptance known (>= 2 characters)."""
    return s.get("features") is not None and s.get("accepted") is not None


def hole_ids(paths: list[str]) -> set[tuple[Any, ...]]:
    """(key, line, col) of every hole in `dlm-lsp eval --samples` files."""
    return {_hole_id(s) for _, s in _samples(paths)}


def load_samples(
    paths: list[str],
    model: str | None = None,
    kinds: tuple[str, ...] | None = None,
    exclude: set[tuple[Any, ...]] | None = None,
) -> tuple[list[list[float]], list[int]]:
    """(feature rows, accepted labels) of the shown-ungated fills in `dlm-lsp eval --samples` files,
    leaving out the holes in `exclude` ((key, line, col): the holes the gate will be judged on)."""
    rows: list[list[float]] = []
    labels: list[int] = []
    for path, s in _samples(paths, model, kinds):
        if (exclude and _hole_id(s) in exclude) or not _has_fill(s):
            continue
        if s.get("feature_names") and tuple(s["feature_names"]) != FEATURES:
            raise SystemExit(f"{path}: samples from another feature set; re-run dlm-lsp eval --samples")
        rows.append(s["features"])
        labels.append(int(bool(s["accepted"])))
    return rows, labels


# (raw confidence, calibrated score, accepted, non-space characters)
GatedFill = tuple[float, float, bool, int]


def _fill(s: dict[str, Any], score: float) -> GatedFill:
    """(raw confidence, calibrated score, accepted, non-space characters) of a sample's fill."""
    chars = round(math.expm1(s["features"][FEATURES.index("log_chars")]))
    return float(s["confidence"]), score, bool(s["accepted"]), chars


def _at_shares(fills: list[GatedFill], holes: int, shares: Sequence[float], per_shown: bool) -> list[dict[str, float]]:
    """fills: _fill tuples. Per shown share: the accepted share of the top-ranked fills under each
    gate, and the characters they give: per shown fill (`per_shown`, key `<gate>_chars_per_shown`)
    or per accepted fill (key `<gate>_chars`; a gate that prefers short fills is accepted more often)."""
    out = []
    for share in shares:
        k = int(round(share * holes))
        if k == 0 or k > len(fills):
            continue
        row: dict[str, float] = {"shown": share}
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


def judge(
    paths: list[str],
    cal: Calibrator,
    model: str | None = None,
    kinds: tuple[str, ...] | None = None,
    shares: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
) -> dict[str, Any]:
    """The raw confidence and the calibrated score as gates on the same filled holes (eval
    --samples files, every hole counted in `shown`'s denominator): accepted among the fills each
    ranks highest when the top `share` of holes are shown, and each one's curve over gates."""
    holes = 0
    fills: list[GatedFill] = []
    for _, s in _samples(paths, model, kinds):
        holes += 1
        if _has_fill(s):
            x = dict(zip(FEATURES, s["features"]))
            fills.append(_fill(s, _sigmoid(cal.bias + sum(w * x[n] for n, w in zip(cal.names, cal.weights)))))
    out: dict[str, Any] = {
        "holes": holes,
        "fills": len(fills),
        "accepted_ungated": round(sum(f[2] for f in fills) / max(1, len(fills)), 4),
        "at_shown": _at_shares(fills, holes, shares, per_shown=False),
        "curves": {},
    }
    for name, i in (("confidence", 0), ("calibrated", 1)):
        pts = []
        for g in [round(0.05 * j, 2) for j in range(21)]:
            sel = [f for f in fills if f[i] >= g]
            pts.append(
                {
                    "gate": g,
                    "shown": round(len(sel) / max(1, holes), 4),
                    "accepted": round(sum(f[2] for f in sel) / max(1, len(sel)), 4),
                }
            )
        out["curves"][name] = pts
    return out


def cross_validate(
    paths: list[str],
    names: tuple[str, ...],
    l2: float,
    folds: int,
    model: str | None = None,
    kinds: tuple[str, ...] | None = None,
    shares: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
) -> dict[str, Any]:
    """Fits on all but one fold of files (sha256 of the hole's file key) and scores the held-out
    fold, for every fold: the raw and the calibrated gate compared out of sample on the fit's own
    samples (how a choice of features is made without the holes it will be judged on)."""
    import hashlib

    per: list[tuple[int, list[float], dict[str, Any]]] = []  # (fold, the fitted features, sample)
    holes = 0
    for _, s in _samples(paths, model, kinds):
        holes += 1
        if _has_fill(s):
            fold = int(hashlib.sha256(str(s.get("key")).encode()).hexdigest()[:8], 16) % folds
            x = dict(zip(FEATURES, s["features"]))
            per.append((fold, [x[n] for n in names], s))
    fills: list[GatedFill] = []
    for k in range(folds):
        train = [p for p in per if p[0] != k]
        labels = [int(bool(p[2]["accepted"])) for p in train]
        if len(set(labels)) < 2:
            raise SystemExit("calibrate --folds: a fold's training side has one class only")
        w, b = fit([p[1] for p in train], labels, l2)
        fills += [_fill(p[2], _sigmoid(b + sum(wi * xi for wi, xi in zip(w, p[1])))) for p in per if p[0] == k]
    return {
        "folds": folds,
        "features": list(names),
        "holes": holes,
        "fills": len(fills),
        "at_shown": _at_shares(fills, holes, shares, per_shown=True),
    }


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("samples", nargs="+", help="JSONL written by dlm-lsp eval --samples (holes not scored later)")
    p.add_argument("--label", default="diffusion", help="the eval's model label to fit on (default diffusion)")
    p.add_argument("--kinds", default=None, help="comma-separated hole kinds to fit on (default all)")
    p.add_argument(
        "--exclude",
        nargs="*",
        default=[],
        metavar="SAMPLES",
        help="leave out the holes of these eval --samples files (the ones the gate is judged on)",
    )
    p.add_argument(
        "--drop",
        default=",".join(DROP),
        help=f"comma-separated FEATURES not to fit (default {','.join(DROP)}; '' fits all)",
    )
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the standardized weights")
    p.add_argument(
        "--write",
        default=None,
        metavar="SERVING_JSON",
        help="store the calibrator in this serving.json (its other keys kept)",
    )
    p.add_argument("--note", default=None, help="a line stored with the fit (where the samples came from)")
    p.add_argument(
        "--judge",
        nargs="*",
        default=[],
        metavar="SAMPLES",
        help="compare the raw and the calibrated gate on these eval --samples files (other holes)",
    )
    p.add_argument(
        "--json", dest="json_out", default=None, metavar="OUT", help="write the fit and the judgement as JSON"
    )
    p.add_argument(
        "--folds",
        type=int,
        default=0,
        metavar="K",
        help="also cross-validate on the samples themselves, K folds of files: raw vs calibrated out of sample",
    )


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
    info = {"fills": len(rows), "accepted": sum(labels), "l2": args.l2, "samples": [Path(p).name for p in args.samples]}
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
            print(
                f"  {row['shown']:.2f}    {row['confidence']:.3f}, {row['calibrated']:.3f}"
                f"                 {row['confidence_chars_per_shown']:.2f}, {row['calibrated_chars_per_shown']:.2f}"
            )
    if args.judge:
        report["judge"] = j = judge(args.judge, cal, args.label, kinds)
        print(f"judged on {j['holes']} holes ({j['fills']} with a fill, {j['accepted_ungated']:.3f} of them accepted):")
        print(
            "  shown   accepted (raw confidence)   accepted (calibrated)   characters per accepted fill (raw, calibrated)"
        )
        for row in j["at_shown"]:
            print(
                f"  {row['shown']:.2f}    {row['confidence']:.3f}                     {row['calibrated']:.3f}"
                f"                   {row['confidence_chars']:.1f}, {row['calibrated_chars']:.1f}"
            )
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
