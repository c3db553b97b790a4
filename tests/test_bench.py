"""`dlm-lsp bench --quick` on a tiny checkpoint: the command runs end to end through the CLI and
writes the JSON the project's reports read. Timing values are only checked for sanity."""
from __future__ import annotations

import json
from pathlib import Path
import math

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
            main(["bench", "--quick", "--model", str(tiny), "--ar-model", str(Path(__file__).resolve().parent.parent / "models" / "default-ar"), "--context", "192"])
    finally:
        torch.set_num_threads(threads)
