"""scripts/gpu_check.sh in its tiny mode (CPU, fp32, tiny shapes): the very code the GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(960)  # the script's own 900 s, not the suite's 300 s per test (a slow machine)
def test_gpu_check_tiny_mode_runs_and_writes_json(tmp_path):
    env = {
        **os.environ,
        "TINY": "1",
        "OUT": str(tmp_path),
        "PY": sys.executable,
        "OMP_NUM_THREADS": "1",
        "TRITON_INTERPRET": "1",
    }  # the kernel section runs its smallest cases through the interpreter
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["mode"] == "tiny" and res["ok"]
    from tests.families_tiny import SPECS

    assert set(res["parity"]) == set(SPECS)  # every family
    for name, row in res["parity"].items():
        assert row["rel_err"] <= 1e-4, name  # fp32 against fp32: the same computation
        assert row["fill_ok"] and row["fill_steps"] >= 1, name  # every family decodes (WeDLM too)
    k = res["kernels"]
    assert k["ok"] and len(k["cases"]) == 3 and all(r["argmax_agree"] == 1.0 for r in k["cases"].values())
    b = res["bench_dream_7b"]
    for key in ("first_forward_ms", "cached_step_ms", "fill32_ms", "fill64_ms"):
        assert b[key] > 0, key
    assert b["batch8"]["serial_ms"] > 0 and len(b["batch8"]["steps"]) == 8
