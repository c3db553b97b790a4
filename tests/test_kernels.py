"""kernels.slot_stats: the Triton kernel (run by Triton's CPU interpreter) against the torch
reference, the reference against plain fp64 maths, and the dispatch switch.

TRITON_INTERPRET=1 only works when it is set before Triton is first imported (Triton decorates its
own language library at import), and this test process may have imported Triton already. So every
kernel case runs in one child process started with the variable set (`_child` below, ~5 s); the
tests here compare what it sends back, one test per case. Interpreted programs cost ~1 ms each and
per loop trip: shapes stay small and vocabulary blocks large.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

# the package re-exports the function under the module's name, so fetch the module itself
ks = importlib.import_module("kernels.slot_stats")

REPO = Path(__file__).resolve().parent.parent
DTYPES = {  # name -> (dtype, atol, rtol): inputs in dtype, maths in fp32 on both sides
    "fp32": (torch.float32, 2e-6, 1e-5),
    "bf16": (torch.bfloat16, 2e-6, 1e-5),
    "fp16": (torch.float16, 2e-6, 1e-5),
}
NAMES = ("max_prob", "argmax", "top2_prob", "entropy")

# (M, D, V, dtype name, ban, launch overrides); BLOCK_V=256 never divides V: the last block is partial
SHAPES = [
    (M, D, V, dt, 7, {"block_v": 256}) for M, D, V, dt in itertools.product((1, 3, 7), (32, 48), (300, 1000), DTYPES)
]
LAUNCH = [  # several programs per row over the vocabulary (merged in torch), D loops of several trips
    (5, 48, 1000, "fp32", -1, {"split": 2, "block_v": 128}),
    (5, 48, 1000, "fp32", -1, {"split": 3, "block_v": 128, "block_d": 16}),
    (20, 48, 1000, "fp32", 999, {"split": 4, "block_v": 64, "block_d": 32}),  # two row blocks
    (5, 48, 1000, "bf16", 0, {"split": 1, "block_v": 1024, "block_d": 16}),
]
VOCAB_150K = [  # Qwen2's 151,936 and Dream's 152,064 entries: ~150 vocabulary blocks of 1024 per row (the interpreter's)
    (3, 32, 151936, "fp32", 151665, {}),
    (2, 32, 152064, "bf16", 151666, {"split": 3}),
]
CASES = SHAPES + LAUNCH + VOCAB_150K


def _case_id(case) -> str:
    M, D, V, dt, ban, kw = case
    return f"M{M}-D{D}-V{V}-{dt}-ban{ban}" + "".join(f"-{k}{v}" for k, v in kw.items())


def _inputs(M, D, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, D, generator=g).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    head_w = (torch.randn(V, D, generator=g) * 0.4).to(dtype)  # logits of std ~3: peaked but not one-hot
    return h, norm_w, head_w


def _compare(got, want, atol, rtol):
    """Liger-style: assert close, and say which rows differ and how."""
    for name, a, b in zip(NAMES, got, want):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if name == "argmax":
            bad = (a != b).nonzero().flatten().tolist()
            assert not bad, f"argmax differs at rows {bad}: kernel {a[bad].tolist()} reference {b[bad].tolist()}"
            continue
        close = torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol)
        if not bool(close.all()):
            rows = (~close).nonzero().flatten().tolist()
            raise AssertionError(
                f"{name} differs at rows {rows}: kernel {a[rows].tolist()} reference {b[rows].tolist()}"
            )


# ---------------------------------------------------------------- the child (TRITON_INTERPRET=1)


def _child() -> None:
    """Runs every case through the interpreted kernel; prints one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from engine.api import DecodeOptions
    from engine.decode.forward import build_canvas
    from engine.decode.sampler import fill
    from tests.engine_models import peaked_model

    out = {"cases": {}}
    for i, case in enumerate(CASES):
        M, D, V, dt, ban, kw = case
        h, nw, hw = _inputs(M, D, V, DTYPES[dt][0], seed=i)
        try:
            got = ks.slot_stats_triton(h, nw, 1e-5, hw, ban=ban, **kw)
            out["cases"][_case_id(case)] = {"kernel": [t.tolist() for t in got]}
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            out["cases"][_case_id(case)] = {"error": repr(e)}

    # the sampler's fast path with the kernel switched in; the parent compares with the oracle
    model = peaked_model(pad=249)
    ks.set_backend("triton")
    calls = []
    real = ks.slot_stats_triton
    ks.slot_stats_triton = lambda *a, **k: calls.append(1) or real(*a, **k)
    prefix, suffix = _e2e_io()
    r = fill(model, build_canvas(prefix, suffix, 5, model.cfg, DecodeOptions(threshold=0.5, cache=False)))
    out["sampler"] = {"ids": r.ids, "kernel_calls": len(calls)}
    print("RESULT " + json.dumps(out))


def _e2e_io():
    g = torch.Generator().manual_seed(4)
    return torch.randint(4, 300, (9,), generator=g).tolist(), torch.randint(4, 300, (4,), generator=g).tolist()


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    env.pop("DLM_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-c", "import tests.test_kernels as t; t._child()"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"kernel child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_matches_reference(interpreted, case):
    M, D, V, dt, ban, _ = case
    res = interpreted["cases"][_case_id(case)]
    assert "error" not in res, res.get("error")
    dtype, atol, rtol = DTYPES[dt]
    h, nw, hw = _inputs(M, D, V, dtype, seed=CASES.index(case))
    want = ks.slot_stats_reference(h, nw, 1e-5, hw, ban=ban)
    _compare(res["kernel"], want, atol, rtol)
    if ban >= 0:
        assert ban not in res["kernel"][1]


def test_sampler_through_the_kernel_matches_the_oracle(interpreted):
    """The fast loop takes its argmax and confidences from kernels.slot_stats: with the kernel
    switched in, a fill still equals the fp64 oracle token for token."""
    from engine.api import DecodeOptions
    from engine.decode.reference import reference_fill
    from tests.engine_models import peaked_model

    res = interpreted["sampler"]
    assert res["kernel_calls"] > 0, "the kernel was not used"
    prefix, suffix = _e2e_io()
    assert res["ids"] == reference_fill(
        peaked_model(pad=249), prefix, suffix, 5, DecodeOptions(threshold=0.5, cache=False)
    )


# ---------------------------------------------------------------- reference and dispatch (in process)


def test_reference_matches_fp64_softmax():
    h, nw, hw = _inputs(6, 40, 500, torch.float32, seed=3)
    x = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    z = x @ hw.double().T
    z[:, 11] = float("-inf")
    p = z.softmax(-1)
    top = p.topk(2, dim=-1)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    want = (top.values[:, 0], top.indices[:, 0], top.values[:, 1], ent)
    _compare(ks.slot_stats_reference(h, nw, 1e-5, hw, ban=11), want, 1e-6, 1e-5)


def test_combine_splits_equals_one_pass():
    """The torch merge of per-split online-softmax states, checked without any kernel."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 90, generator=g) * 3  # (M, V) logits
    states = []
    for part in z.split(30, dim=1):  # three splits of 30 tokens
        m = part.max(1).values
        e = torch.exp(part - m[:, None])
        top = part.topk(2, dim=1)
        states.append(
            (m, e.sum(1), ((part - m[:, None]) * e).sum(1), top.values[:, 0], top.indices[:, 0], top.values[:, 1])
        )
    stacked = [torch.stack(x) for x in zip(*states)]
    stacked[4] = stacked[4] + torch.arange(3)[:, None] * 30  # split-local -> global token ids
    got = ks._combine_splits(*stacked)
    p = z.softmax(1)
    top = p.topk(2, dim=1)
    want = (top.values[:, 0], top.indices[:, 0], top.values[:, 1], -(p * p.log()).sum(1))
    _compare(got, want, 1e-6, 1e-5)


def test_dispatch_switch_and_env_override(monkeypatch):
    assert ks.backend() in ("torch", "triton")
    prev = ks.set_backend("torch")
    try:
        assert ks.backend() == "torch"
        with pytest.raises(ValueError):
            ks.set_backend("cuda-magic")
    finally:
        ks.set_backend(prev)
    try:
        monkeypatch.setenv("DLM_KERNELS", "triton")
        assert importlib.reload(ks).backend() == "triton"
        monkeypatch.setenv("DLM_KERNELS", "torch")
        assert importlib.reload(ks).backend() == "torch"
        monkeypatch.delenv("DLM_KERNELS")
        assert importlib.reload(ks).backend() == ("triton" if torch.cuda.is_available() else "torch")
    finally:
        monkeypatch.delenv("DLM_KERNELS", raising=False)
        importlib.reload(ks)


def test_cpu_tensors_without_interpreter_use_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    prev = ks.set_backend("triton")
    calls = []
    monkeypatch.setattr(ks, "slot_stats_triton", lambda *a, **k: calls.append(1))
    try:
        h, nw, hw = _inputs(2, 32, 300, torch.float32)
        out = ks.slot_stats(h, nw, 1e-5, hw)
        assert not calls and len(out) == 4
    finally:
        ks.set_backend(prev)


# ---------------------------------------------------------------- compiled for a GPU, without one

_COMPILE_CHILD = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
ks = importlib.import_module("kernels.slot_stats")
out = {}
for dt, bd in (("fp32", 128), ("bf16", 64), ("fp16", 16)):
    p = "*" + dt
    sig = {"h_ptr": p, "g_ptr": p, "w_ptr": p, "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32",
           "t1_ptr": "*fp32", "t1i_ptr": "*i32", "t2_ptr": "*fp32", "M": "i32", "D": "i32", "V": "i32",
           "stride_hm": "i32", "stride_wv": "i32", "eps": "fp32", "ban": "i32", "v_per_split": "i32",
           "BLOCK_M": "constexpr", "BLOCK_D": "constexpr", "BLOCK_V": "constexpr"}
    src = ASTSource(ks._slot_stats_kernel, sig, constexprs={"BLOCK_M": 16, "BLOCK_D": bd, "BLOCK_V": 128})
    out[dt] = sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm)
print("RESULT " + json.dumps(out))
"""


def test_kernel_compiles_for_hopper_without_a_gpu():
    """Triton's compiler for an H200 (sm_90) runs on the CPU: the interpreter forgives what the compiler
    rejects (a plain float global read in the kernel passed every interpreted case and broke every GPU
    fill, found on the first H200 lease), so the kernel is compiled down to a cubin here too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    for dt, stages in json.loads(line[len("RESULT ") :]).items():
        assert {"ttir", "ptx", "cubin"} <= set(stages), dt
