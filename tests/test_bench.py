"""`dlm-lsp bench --quick` on a tiny checkpoint: the command runs end to end through the CLI and
writes the JSON the project's reports read. Timing values are only checked for sanity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dlm_lsp.cli import main
from tests.tiny import make_tiny_checkpoint

KEYS = ("cached_speedup", "ar_speedup_64", "fill32_p50_ms", "tokens_per_step", "batch4_speedup")


def test_quick_bench_writes_sane_json(tmp_path, capsys):
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--quick", "--model", str(tiny), "--context", "192", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())
    for k in KEYS:
        assert isinstance(res[k], (int, float)) and math.isfinite(res[k]) and res[k] > 0, k
    s = res["settings"]
    assert s["quick"] and s["context_tokens"] == 192 and s["sizes"] == [16, 32, 64]
    assert s["ar_trained"] is False and "random" in s["ar_model"]
    assert s["decode_options"]["selection"] == "threshold"
    modes = {(r["mode"], r["n"]) for r in res["rows"]}
    assert modes == {(m, n) for m in ("full", "cached", "ar") for n in (16, 32, 64)}
    for r in res["rows"]:
        assert r["ms_p50"] > 0 and 1 <= r["steps"] <= r["n"] and r["tokens_per_step"] >= 1
    assert res["batch"]["jobs"] == 4 and res["batch"]["max_batch_seen"] >= 2
    printed = capsys.readouterr().out
    assert "cached_speedup" in printed and "random weights" in printed


def test_a_twin_with_another_vocabulary_is_refused(tmp_path):
    import pytest

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit, match="vocabulary"):
            main(
                [
                    "bench",
                    "--quick",
                    "--model",
                    str(tiny),
                    "--ar-model",
                    str(Path(__file__).resolve().parent.parent / "models" / "default-ar"),
                    "--context",
                    "192",
                ]
            )
    finally:
        torch.set_num_threads(threads)


def _incremental(tmp_path, model, keys: int = 4):
    out = tmp_path / "inc.json"
    threads = torch.get_num_threads()
    try:
        rc = main(
            [
                "bench",
                "--incremental",
                "--model",
                str(model),
                "--context",
                "192",
                "--sizes",
                "8",
                "--keys",
                str(keys),
                "--threads",
                "1",
                "--file",
                str(Path(__file__).resolve().parent.parent / "examples" / "tide_log.py"),
                "--json",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return json.loads(out.read_text())


def test_incremental_bench_compares_reuse_with_full_recompute(tmp_path, capsys):
    res = _incremental(tmp_path, make_tiny_checkpoint(tmp_path / "m", attention="causal", canvas="reorder"))
    assert res["mode"] == "incremental" and res["reuse_available"] and res["reuse_note"] is None
    assert res["keystrokes"] == 4 and res["slots"] == 8 and 100 < res["canvas_tokens"] <= 192
    full, reuse = res["full"], res["reuse"]
    for s in (full, reuse):
        assert 0 < s["ms_p50"] <= s["ms_p95"] and 0 < s["first_step_ms_p50"] and s["steps_mean"] >= 1
    assert full["reused_tokens_mean"] == 0 and full["reuse_share"] == 0
    assert reuse["reuse_share"] >= 0.5 and reuse["reused_tokens_mean"] > 0  # a 64-token cut may move once
    assert reuse["forwarded_tokens_mean"] < full["forwarded_tokens_mean"] and 0 < res["forwarded_ratio"] < 1
    assert res["identical_fills"] is True  # exact reuse: the same tokens as the full recompute
    assert res["speedup_p50"] > 0 and len(res["per_keystroke"]) == 4
    for row in res["per_keystroke"]:
        assert row["full_forwarded"] == row["reuse_forwarded"] + row["reuse_reused"]  # same steps, context reused
    printed = capsys.readouterr().out
    assert "full recompute" in printed and "faster per keystroke" in printed


def test_incremental_bench_runs_approximate_reuse_for_a_bidirectional_model(tmp_path, capsys):
    res = _incremental(tmp_path, make_tiny_checkpoint(tmp_path / "m"), keys=3)
    assert res["reuse_available"] and res["reuse_kind"] == "approximate" and res["reuse_note"] is None
    assert res["layout"] == {"attention": "bidirectional", "canvas": None}
    full, reuse = res["full"], res["reuse"]
    assert full["forwarded_tokens_mean"] > res["canvas_tokens"] and full["reused_tokens_mean"] == 0
    assert reuse["reuse_share"] > 0 and reuse["forwarded_tokens_mean"] < full["forwarded_tokens_mean"]
    assert 0 < res["forwarded_ratio"] < 1 and res["identical_fills"] is None and 0 <= res["same_fills_share"] <= 1
    assert res["reuse_budget"] == 32 and res["full_recomputes"] == sum(
        r["reuse_outcome"] != "reused" for r in res["per_keystroke"]
    )
    for row in res["per_keystroke"]:
        assert row["reuse_outcome"] in ("reused", "full_new", "full_model", "full_stale", "full_jump")
        assert (row["reuse_reused"] > 0) == (row["reuse_outcome"] == "reused")
    printed = capsys.readouterr().out
    assert "approximate reuse" in printed and "budget 32" in printed


def test_cold_start_bench_times_each_case_with_and_without_the_hint(tmp_path):
    """bench --cold-start spawns real servers (tiny model): every case answers initialize, gets ready
    and answers a fill, in that order, with the hint off and on; the JSON holds each time."""
    out = tmp_path / "cold.json"
    assert main(["bench", "--cold-start", "--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "cold-start" and res["rounds"] == 1
    assert set(res["runs"]) == {f"{c} {h}" for c in ("inproc", "shared", "running") for h in ("off", "on")}
    for case, runs in res["runs"].items():
        (r,) = runs
        assert 0 < r["initialize_s"] <= r["ready_s"] <= r["first_fill_s"] < 180, (case, r)
    assert set(res["first_fill_on_over_off"]) == {"inproc", "shared", "running"}


def test_next_edit_bench_times_each_approach_beside_the_fill(tmp_path, capsys):
    """`bench --next-edit` on cases in the `corpus --edits` layout: every counted case timed for the
    fill, each approach asked and propagate; ratios are each p95 over the fill's p95, from the same run."""
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    cases = tmp_path / "cases"
    old = "def scale(value, factor):\n    total = value * factor\n    return total + value\n"
    rows = []
    for i in range(4):
        f = f"files/heldout_packages/p/1.0/m{i}.py"
        (cases / f).parent.mkdir(parents=True, exist_ok=True)
        (cases / f).write_text(old)
        doc = old.replace("(value,", "(v,")
        rows.append(
            {
                "id": f"p@1.0..1.1:m{i}.py#hunk2",
                "category": "repeat",
                "path": f"m{i}.py",
                "file": f,
                "edits": [[10, "value", "v"]],
                "cursor": 11,
                "truth": [doc.index("value"), "value", "v"],
            }
        )
    (cases / "heldout_packages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "edit.json"
    threads = torch.get_num_threads()
    argv = ["bench", "--next-edit", "--model", str(tiny), "--threads", "1", "--edit-cases", str(cases)]
    try:
        rc = main([*argv, "--cases", "3", "--warmup", "1", "--edit-approaches", "surprise", "--json", str(out)])
        assert main([*argv, "--edit-approaches", "guess"]) == 2  # an unknown approach: a clear refusal
        assert main([*argv, "--cases", "0", "--warmup", "4"]) == 2  # nothing left to count
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())
    assert (
        res["mode"] == "next-edit" and res["settings"]["cases"] == 3 and res["settings"]["approaches"] == ["surprise"]
    )
    r = res["results"]
    assert list(r) == ["fill", "surprise", "propagate"]
    for k, v in r.items():
        assert v["n"] == 3 and 0 < v["p50_ms"] <= v["p95_ms"], k
    assert r["surprise"]["p95_vs_fill"] == round(r["surprise"]["p95_ms"] / r["fill"]["p95_ms"], 2)
    printed = capsys.readouterr()
    assert "| surprise | 3 |" in printed.out and "unknown next-edit approach guess" in printed.err
