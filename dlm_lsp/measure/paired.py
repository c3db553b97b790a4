"""Two runs of `dlm-lsp eval --samples` on the same holes, compared hole by hole: the characters a
user keeps per hole (the tables' "kept chars": the accepted shown fill's length, else 0) as a paired
mean difference with its standard error, and the exact fills each run got that the other did not.

    dlm-lsp paired A.jsonl:B.jsonl [A2.jsonl:B2.jsonl ...] [--json OUT]
    python -m dlm_lsp.measure.paired A.jsonl:B.jsonl ...     # the same command

Each argument is one pair (A first); pairs are pooled per hole kind. The holes of a pair must be
the same (key, line, column and kind, in order; the same --seed, --per-kind, --kinds, --heldout).
Samples written before session 24 lack the "exact" and "kept_chars" fields; for them exact is the
shown fill against the middle alone (a fill that re-types closers after the cursor is not counted)
and kept characters use the ungated fill's "accepted" (the same at gate 0)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dlm_lsp.measure.evaluate import exact_match


def _kept(s: dict) -> int:
    if "kept_chars" in s:
        return int(s["kept_chars"])
    return len(s["shown"].rstrip()) if s.get("accepted") and s["shown"] == s.get("ungated", s["shown"]) else 0


def _exact(s: dict) -> bool:
    return bool(s["exact"]) if "exact" in s else exact_match(s["shown"], s["middle"])


def _load(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def compare(pairs: list[tuple[str, str]]) -> dict:
    """{kind: {holes, kept_a, kept_b, kept_diff, kept_diff_se, exact_a, exact_b, won, lost}}; `won`:
    holes B gets exactly right and A does not."""
    by: dict[str, list[tuple[dict, dict]]] = {}
    for pa, pb in pairs:
        a, b = _load(pa), _load(pb)
        if len(a) != len(b):
            raise ValueError(f"{pa} has {len(a)} holes, {pb} has {len(b)}: not the same holes")
        for x, y in zip(a, b):
            if (x["key"], x["line"], x["col"], x["kind"]) != (y["key"], y["line"], y["col"], y["kind"]):
                raise ValueError(f"{pa} and {pb} differ at {x['key']}:{x['line']}:{x['col']}: not the same holes")
            by.setdefault(x["kind"], []).append((x, y))
    out = {}
    for kind, xs in by.items():
        d = [_kept(y) - _kept(x) for x, y in xs]
        n = len(d)
        mean = sum(d) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n) if n > 1 else float("nan")
        out[kind] = {
            "holes": n,
            "kept_a": round(sum(_kept(x) for x, _ in xs) / n, 3),
            "kept_b": round(sum(_kept(y) for _, y in xs) / n, 3),
            "kept_diff": round(mean, 3),
            "kept_diff_se": round(se, 3),
            "exact_a": sum(_exact(x) for x, _ in xs),
            "exact_b": sum(_exact(y) for _, y in xs),
            "won": sum(_exact(y) and not _exact(x) for x, y in xs),
            "lost": sum(_exact(x) and not _exact(y) for x, y in xs),
        }
    return out


def _pair(arg: str) -> tuple[str, str]:
    """One command-line pair, "A.jsonl:B.jsonl" (split at its last colon)."""
    a, sep, b = arg.rpartition(":")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"{arg!r}: expected A.jsonl:B.jsonl")
    return a, b


def add_paired_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "pairs",
        nargs="+",
        type=_pair,
        metavar="A.jsonl:B.jsonl",
        help="two eval --samples files of the same holes (A first); several pairs are pooled per kind",
    )
    p.add_argument("--json", help="write the comparison here")


def run_paired(args: argparse.Namespace) -> int:
    pairs = list(args.pairs)
    try:
        res = compare(pairs)
    except (OSError, ValueError, KeyError) as e:
        print(f"paired: {e}", file=sys.stderr)
        return 2
    for kind, r in res.items():
        print(
            f"{kind:6s} {r['holes']:5d} holes  kept chars {r['kept_a']:.3f} -> {r['kept_b']:.3f} "
            f"(paired {r['kept_diff']:+.3f} +- {r['kept_diff_se']:.3f})  exact {r['exact_a']} -> {r['exact_b']} "
            f"(won {r['won']}, lost {r['lost']})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"pairs": [list(x) for x in pairs], "by_kind": res}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlm_lsp.measure.paired", description=__doc__.split("\n\n")[0])
    add_paired_args(p)
    return run_paired(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
