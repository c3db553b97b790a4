"""`dlm-lsp bench --gpu` (dlm_lsp/measure/gpu_bench.py): its dry run on the CPU, the very code a lent GPU
runs, writes every section with sane numbers; the real shapes are the published ones; the profile
counter reads launches, syncs and the SDPA backend as a CUDA profile names them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlm_lsp.measure import gpu_bench, gpu_setup, gpu_steps

REPO = Path(__file__).resolve().parent.parent
BACKENDS = {"flash", "efficient", "cudnn", "math"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-bench") / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dlm_lsp", "bench", "--gpu", "--dry-run", "--threads", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "copy bandwidth" in proc.stdout and f"torch {torch.__version__}" in proc.stdout  # the table names both
    return json.loads(out.read_text())


def test_the_dry_run_writes_every_section(dry_run):
    r = dry_run
    assert r["mode"] == "dry-run" and r["complete"] and r["torch"] == torch.__version__
    assert r["modes"] == ["loop", "eager"] and r["graph"].startswith("skipped")  # no CUDA graphs on a CPU
    assert r["bandwidth"]["gb_s"] > 0 and r["context_tokens"] == 128
    assert list(r["models"]) == list(gpu_setup.MODELS)
    for name, m in r["models"].items():
        assert not [k for k, v in m.items() if isinstance(v, dict) and "error" in v], name
        assert m["params"] > 0 and 0 < m["bytes_per_step"] and m["floor_ms"] > 0, name
        cached = m["cached_step"]
        assert list(cached["rows"]) == ["16", "32", "48"] and cached["first_forward_ms"] > 0
        for by_mode in cached["rows"].values():
            assert set(by_mode) == {"loop", "eager"}
            assert all(v["ms"] > 0 and v["floor_ratio"] > 0 and v["steps_timed"] >= 1 for v in by_mode.values())
        for mode, p in m["profile"].items():
            assert p["ops_per_step"] > 0 and p["launches_per_step"] == 0 == p["syncs_per_step"], (name, mode)
            assert p["sdpa"] and set(p["sdpa"]) <= BACKENDS, (name, mode)
        forced = {k: v for k, v in m["forced"].items() if k != "note"}
        assert sorted(forced) == sorted(f"{n}x{k}" for n in (32, 64) for k in (4, 8, 16))
        for f in forced.values():
            assert f["loop"]["ms"] > 0 and f["eager"]["ms"] > 0 and f["speedup"] > 0
            assert f["loop"]["steps"] == f["eager"]["steps"] >= 1  # the fixed-shape step decodes as the loop does
            if m["shape"]["attention"] == "bidirectional":
                assert f["loop"]["steps"] <= f["steps"]  # a forced schedule (an end may stop it sooner)
        assert ("note" in m["forced"]) == (m["shape"]["attention"] == "block_causal")
        c = m["concurrency"]
        assert c["jobs"] == 8 and c["ratio"] > 0 and c["one_at_a_time"]["tokens"] > 0 and c["concurrent"]["tokens"] > 0
        k = m["cancel"]
        assert all(run["cancelled"] and run["steps"] < 64 for run in k["runs"]) and k["latency_ms_p50"] > 0


def test_keystrokes_reuse_the_session_where_attention_is_full(dry_run):
    for name in ("dream-7b", "llada-8b"):
        r = dry_run["models"][name]["reuse"]
        assert r["first_reused_tokens"] == 0  # the first keystroke is a miss: a full prefill
        assert r["hits"] >= 1 and r["hit_reused_tokens_p50"] > 0, name
        assert r["hit_forwarded_tokens_p50"] < r["first_forwarded_tokens"] <= r["no_session_forwarded_tokens_p50"] + 1
    assert "not_applicable" in dry_run["models"]["sdar-8b"]["reuse"]  # block-causal: no approximate reuse


@pytest.mark.parametrize(
    "name, shape, billions",
    [
        ("dream-7b", (28, 3584, 28, 4, 18944, 152064, True, "bidirectional", 0), 7.62),
        ("llada-8b", (32, 4096, 32, 32, 12288, 126464, False, "bidirectional", 0), 8.02),
        ("sdar-8b", (36, 4096, 32, 8, 12288, 151936, False, "block_causal", 4), 8.19),
    ],
)
def test_the_real_shapes_are_the_published_ones(name, shape, billions):
    from engine.model.transformer import Transformer

    cfg = gpu_setup.model_config(name, dry=False)
    got = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim, cfg.vocab_size)
    assert got + (cfg.logits_shift, cfg.attention, cfg.block_size) == shape
    assert cfg.head_dim == 128 and not cfg.tie_embeddings
    with torch.device("meta"):  # no memory: the shapes only
        model = Transformer(cfg).to(torch.bfloat16)
    assert model.num_params() / 1e9 == pytest.approx(billions, rel=0.01)
    embedding = cfg.vocab_size * cfg.dim * 2
    kv = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * (2048 + 32) * 2
    assert gpu_setup.step_bytes(model, 2048, 32) == model.num_params() * 2 - embedding + kv


def test_the_profile_counter_reads_a_cuda_profile():
    step = [
        *[("cudaLaunchKernel", False)] * 6,
        ("cuLaunchKernelEx", False),  # Triton's launches go through the driver API
        ("cudaGraphLaunch", False),
        ("cudaMemcpyAsync", False),
        ("cudaStreamSynchronize", False),
        ("Memcpy DtoH (Device -> Pageable)", True),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", True),
        ("void at::native::vectorized_elementwise_kernel<4>", True),
        ("aten::mm", False),
    ]
    p = gpu_steps.count_events(step * 2, steps=2)
    assert (p["launches_per_step"], p["graph_launches_per_step"], p["syncs_per_step"]) == (7, 1, 1)
    assert (p["dtoh_copies_per_step"], p["kernels_per_step"], p["ops_per_step"]) == (1, 2, 1)
    assert p["sdpa"] == ["efficient"] and p["sdpa_from"] == "kernel names"  # a graph replay dispatches no aten op
    eager = gpu_steps.count_events([("aten::_scaled_dot_product_flash_attention", False)], steps=1)
    assert eager["sdpa"] == ["flash"] and eager["sdpa_from"] == "aten op"
    assert gpu_steps.count_events([("aten::_scaled_dot_product_attention_math", False)], 1)["sdpa"] == ["math"]


def test_the_bench_command_keeps_the_cpu_bench_and_refuses_gpu_without_cuda(capsys):
    from dlm_lsp.cli import build_parser

    args = build_parser("bench").parse_args(["bench"])
    assert not args.gpu and not args.dry_run and args.context is None  # run_bench gives the CPU bench its 512
    args = build_parser("bench").parse_args(["bench", "--gpu", "--models", "dream-7b,sdar-8b", "--budget-s", "30"])
    assert args.gpu and args.models == "dream-7b,sdar-8b" and args.budget_s == 30
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert gpu_bench.run_gpu_bench(args) == 2
    assert "no CUDA device" in capsys.readouterr().err
    bad = argparse.Namespace(**{**vars(args), "dry_run": True, "models": "gpt-9"})
    assert gpu_bench.run_gpu_bench(bad) == 2
