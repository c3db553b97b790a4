"""`dlm-lsp ctxbench`: the per-keystroke server work on a big file, timed without the engine."""

import argparse
import json

from dlm_lsp.measure import ctxbench


def test_ctxbench_types_into_a_big_file_and_reports(tmp_path):
    out = tmp_path / "ctx.json"
    args = argparse.Namespace(lines=400, keystrokes=15, seed=0, json_out=str(out))
    assert ctxbench.run_ctxbench(args) == 0
    res = json.loads(out.read_text())
    assert res["lines"] == 400 and res["keystrokes"] == 15
    for name in ("didchange", "context", "postprocess", "context_post", "total"):
        assert 0 < res[f"{name}_p50_ms"] <= res[f"{name}_p95_ms"] <= res[f"{name}_max_ms"]
    assert res["total_p95_ms"] >= res["context_p95_ms"]


def test_big_source_is_real_code_of_the_asked_size():
    text = ctxbench.big_source(250)
    assert text.count("\n") == 250
    assert "def " in text
