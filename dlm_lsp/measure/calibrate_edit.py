"""`dlm-lsp calibrate-edits`: fitting the next-edit gate (dlm_lsp/fill/edit_gate.py) on eval samples.

The samples are the propagation baseline's suggestions shown without a gate, with the kind and
features the gate reads and whether each was the developer's next edit (`exact`) or moved the window
away from it (`farther`): `dlm-lsp eval --kinds edit --edit-side train --edit-gate none --approaches ''
--samples F` on the train side's release pairs, so the held-out packages stay for judging it.

`fit` (calibrate.fit, the fill gate's logistic regression) gives P(exact) from the features. Each
kind's gate is read off out-of-fold probabilities (folds of packages, so a package's suggestions are
never scored by a fit that saw them): the least probability at which that kind's suggestions at or
above it are at least --exact exact and at most --farther farther, over at least --min-shown of them;
a kind that never gets there is hidden (gate 1.0). The weights stored are the fit on every sample.
`--judge` scores held-out samples (the same eval on the held-out sides, --edit-gate none) with the
fitted gate: what the server would show there, per kind and in all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlm_lsp.fill.edit_gate import FEATURES, KINDS, PATH, EditGate
from dlm_lsp.fill.gate import _sigmoid
from dlm_lsp.measure.calibrate import fit


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The propagate samples of `eval --kinds edit --samples` files that were shown and carry features."""
    out = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            s = json.loads(line)
            if s.get("approach") == "propagate" and s.get("shown") and s.get("features") and s.get("kind"):
                if len(s["features"]) != len(FEATURES):
                    raise ValueError(
                        f"{path}: samples with {len(s['features'])} features, the gate has {len(FEATURES)}"
                    )
                out.append(s)
    return out


def package(sample: dict[str, Any]) -> str:
    """The package a sample's case came from (its id: `package@old..new:path#hunk`)."""
    return str(sample["id"]).split("@", 1)[0]


def _fold(name: str, k: int) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % k


def probabilities(weights: Sequence[float], bias: float, rows: Sequence[Sequence[float]]) -> list[float]:
    return [_sigmoid(bias + sum(w * x for w, x in zip(weights, r))) for r in rows]


def out_of_fold(samples: Sequence[dict[str, Any]], k: int, l2: float) -> list[float]:
    """Each sample's P(exact) from a fit on the other folds' packages (a fold with no other-fold
    samples of both outcomes gets the overall exact share)."""
    folds = [_fold(package(s), k) for s in samples]
    prior = sum(s["exact"] for s in samples) / len(samples)
    out = [prior] * len(samples)
    for f in range(k):
        train = [s for s, g in zip(samples, folds) if g != f]
        labels = [int(s["exact"]) for s in train]
        if len(set(labels)) < 2:
            continue
        w, b = fit([s["features"] for s in train], labels, l2)
        idx = [i for i, g in enumerate(folds) if g == f]
        for i, p in zip(idx, probabilities(w, b, [samples[i]["features"] for i in idx])):
            out[i] = p
    return out


def least_gate(scored: Sequence[tuple[float, dict[str, Any]]], exact: float, farther: float, min_shown: int) -> float:
    """The least probability g such that the samples scored >= g are at least `exact` exact and at
    most `farther` farther, over at least `min_shown` of them; 1.0 when none is."""
    for g in sorted({0.0, *(p for p, _ in scored)}):
        shown = [s for p, s in scored if p >= g]
        if len(shown) < min_shown:
            break
        n = len(shown)
        if sum(s["exact"] for s in shown) / n >= exact and sum(s["farther"] for s in shown) / n <= farther:
            return g
    return 1.0


def tally(samples: Sequence[dict[str, Any]], shown: Sequence[bool]) -> dict[str, Any]:
    """Shown, exact, closer, farther of the samples marked shown, by category and in all."""
    rows: dict[str, Any] = {}
    for group in ("repeat", "other", "noise", "all"):
        mine = [s for s, y in zip(samples, shown) if y and (group == "all" or s["category"] == group)]
        rows[group] = {
            "shown": len(mine),
            "exact": sum(s["exact"] for s in mine),
            "closer": sum(s["closer"] for s in mine),
            "farther": sum(s["farther"] for s in mine),
        }
    return rows


def judge(samples: Sequence[dict[str, Any]], gate: EditGate) -> dict[str, Any]:
    """What `gate` shows of ungated samples: tallies with no gate and with it."""
    probs = [gate.score(s["features"]) for s in samples]
    kept = [p >= gate.gates.get(s["kind"], 0.0) for p, s in zip(probs, samples)]
    return {
        "suggestions": len(samples),
        "ungated": tally(samples, [True] * len(samples)),
        "gated": tally(samples, kept),
    }


def _line(name: str, t: dict[str, Any]) -> str:
    a = t["all"]
    n = a["shown"] or 1
    return (
        f"  {name:8s} shown {a['shown']:4d}  exact {a['exact']:4d} ({a['exact'] / n:.0%})  closer {a['closer']:4d}"
        f" ({a['closer'] / n:.0%})  farther {a['farther']:4d} ({a['farther'] / n:.0%})"
        f"  | repeat shown {t['repeat']['shown']} exact {t['repeat']['exact']}, noise shown {t['noise']['shown']}"
    )


def add_calibrate_edit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "samples", nargs="+", help="JSONL of dlm-lsp eval --kinds edit --edit-gate none --samples (train side)"
    )
    p.add_argument("--exact", type=float, default=0.5, help="each kind's shown suggestions at least this exact")
    p.add_argument("--farther", type=float, default=0.15, help="... and at most this farther")
    p.add_argument("--min-shown", type=int, default=5, help="... over at least this many suggestions")
    p.add_argument("--folds", type=int, default=4, help="folds of packages for the out-of-fold probabilities")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the standardized weights")
    p.add_argument("--judge", nargs="*", default=[], metavar="SAMPLES", help="held-out samples to show the gate on")
    p.add_argument("--write", default=None, metavar="JSON", help=f"store the gate here (the shipped one: {PATH})")
    p.add_argument("--note", default=None, help="a line stored with the fit (where the samples came from)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the fit and judgement as JSON")


def run_calibrate_edit(args: argparse.Namespace) -> int:
    try:
        samples = load(args.samples)
        held = load(args.judge) if args.judge else []
    except (OSError, ValueError) as e:
        print(f"calibrate-edits: {e}", file=sys.stderr)
        return 2
    labels = [int(s["exact"]) for s in samples]
    if len(samples) < 20 or len(set(labels)) < 2:
        print(f"calibrate-edits: {len(samples)} suggestions, {sum(labels)} exact: too few to fit", file=sys.stderr)
        return 1
    oof = out_of_fold(samples, args.folds, args.l2)
    gates = {
        kind: least_gate(
            [(p, s) for p, s in zip(oof, samples) if s["kind"] == kind], args.exact, args.farther, args.min_shown
        )
        for kind in KINDS
    }
    weights, bias = fit([s["features"] for s in samples], labels, args.l2)
    info: dict[str, Any] = {
        "suggestions": len(samples),
        "exact": sum(labels),
        "packages": len({package(s) for s in samples}),
        "by_kind": {k: sum(s["kind"] == k for s in samples) for k in KINDS},
        "targets": {"exact": args.exact, "farther": args.farther, "min_shown": args.min_shown},
        "folds": args.folds,
        "l2": args.l2,
        "samples": [Path(p).name for p in args.samples],
    }
    if args.note:
        info["note"] = args.note
    gate = EditGate(FEATURES, tuple(weights), bias, gates, info)
    for name, w in zip(FEATURES, weights):
        print(f"  {name:14s} {w:+.3f}")
    print(
        f"  {'bias':14s} {bias:+.3f}   ({len(samples)} suggestions of {info['packages']} packages, {sum(labels)} exact)"
    )
    print("  gates: " + ", ".join(f"{k} {v:.3f} ({info['by_kind'][k]} suggestions)" for k, v in gates.items()))
    oof_kept = [p >= gates[s["kind"]] for p, s in zip(oof, samples)]
    report: dict[str, Any] = {
        "edit_gate": gate.to_json(),
        "out_of_fold": {"ungated": tally(samples, [True] * len(samples)), "gated": tally(samples, oof_kept)},
    }
    print("out of fold (train side):")
    print(_line("ungated", report["out_of_fold"]["ungated"]))
    print(_line("gated", report["out_of_fold"]["gated"]))
    if held:
        report["judge"] = j = judge(held, gate)
        print(f"judged on {len(held)} held-out suggestions:")
        print(_line("ungated", j["ungated"]))
        print(_line("gated", j["gated"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.write:
        Path(args.write).write_text(json.dumps(gate.to_json(), indent=2) + "\n")
        print(f"edit gate written to {args.write}")
    return 0
