"""kernels.slot_stats: the Triton kernel (run by Triton's CPU interpreter) against the torch
reference, with and without a restriction to allowed token sets, the reference against plain fp64
maths, the dispatch switch, and the kernel compiled for sm_90 (fp32, and bf16/fp16 on tensor cores).

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
DTYPES = {  # name -> (dtype, atol, rtol): inputs in dtype; the reference's maths is fp32
    "fp32": (torch.float32, 2e-6, 1e-5),  # the kernel's dot is fp32 too: only the summation order differs
    # bf16/fp16 heads run on tensor cores: the normed row is rounded to the dtype (2^-9, 2^-12 relative),
    # so logits of std ~3 over D <= 48 move by up to ~0.02 / ~0.003. Worst over these cases (abs, rel):
    # bf16 max prob 2.3e-3, 4.9e-3; entropy 9e-3, 3.9e-3; fp16 entropy 1.5e-3, 4e-4
    "bf16": (torch.bfloat16, 5e-3, 5e-3),
    "fp16": (torch.float16, 1e-3, 1e-3),
}
NAMES = ("max_prob", "argmax", "top2_prob", "entropy")

# (M, D, V, dtype name, ban, launch overrides); BLOCK_V=256 never divides V: the last block is partial
SHAPES = [
    (M, D, V, dt, 7, {"block_v": 256}) for M, D, V, dt in itertools.product((1, 3, 7), (32, 48), (300, 1000), DTYPES)
] + [(5, 37, 999, dt, 998, {"block_v": 256}) for dt in DTYPES]  # the odd shape: D, V odd, the last id banned
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
# rows restricted to allowed sets (`_allow_inputs`), as token healing restricts its slot to candidates
RESTRICTED = [
    (6, 48, 1000, "fp32", 7, {"block_v": 256}),
    (6, 48, 1000, "fp16", -1, {"block_v": 256}),
    (6, 37, 999, "bf16", 998, {"block_v": 128, "split": 3}),  # splits where a restricted row allows nothing
    (20, 48, 1000, "fp32", 999, {"split": 4, "block_v": 64, "block_d": 32}),  # two row blocks
    (3, 32, 152064, "bf16", 151666, {"split": 3}),  # Dream's vocabulary: a few candidates of 152k
]


def _case_id(case) -> str:
    M, D, V, dt, ban, kw = case
    return f"M{M}-D{D}-V{V}-{dt}-ban{ban}" + "".join(f"-{k}{v}" for k, v in kw.items())


def _inputs(M, D, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, D, generator=g).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    head_w = (torch.randn(V, D, generator=g) * 0.4).to(dtype)  # logits of std ~3: peaked but not one-hot
    return h, norm_w, head_w


def _allow_inputs(M, V, ban):
    """(allow (3, V) bool, allow_row (M,) int64): a random ~5% of the vocabulary, the last id not banned
    alone, and ids 1 and 2 with the banned id (still banned inside a set); rows cycle through sets 0, 1,
    2, none."""
    g = torch.Generator().manual_seed(V)
    allow = torch.zeros(3, V, dtype=torch.bool)
    allow[0] = torch.rand(V, generator=g) < 0.05
    allow[1, V - 1 if ban != V - 1 else V - 2] = True
    allow[2, [1, 2, max(ban, 0)]] = True
    allow_row = (torch.arange(M) + 1) % 4 - 1
    return allow, allow_row


def _compare(got, want, atol, rtol):
    """Liger-style: assert close, and say which rows differ and how. Argmax must be equal where the
    reference's best probability beats its second by more than the tolerance; closer rows may swap
    within the dtype's rounding (their probabilities are still compared)."""
    for name, a, b in zip(NAMES, got, want):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if name == "argmax":
            p1, p2 = torch.as_tensor(want[0]).double(), torch.as_tensor(want[2]).double()
            decided = p1 - p2 > atol + rtol * p1  # (M,) the top-2 margin exceeds the tolerance
            bad = ((a != b) & decided).nonzero().flatten().tolist()
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

    out: dict = {"cases": {}, "restricted": {}}
    for i, case in enumerate(CASES):
        M, D, V, dt, ban, kw = case
        h, nw, hw = _inputs(M, D, V, DTYPES[dt][0], seed=i)
        try:
            got = ks.slot_stats_triton(h, nw, 1e-5, hw, ban=ban, **kw)
            out["cases"][_case_id(case)] = {"kernel": [t.tolist() for t in got]}
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            out["cases"][_case_id(case)] = {"error": repr(e)}
    for i, case in enumerate(RESTRICTED):
        M, D, V, dt, ban, kw = case
        h, nw, hw = _inputs(M, D, V, DTYPES[dt][0], seed=i)
        allow, allow_row = _allow_inputs(M, V, ban)
        try:
            got = ks.slot_stats_triton(h, nw, 1e-5, hw, ban=ban, allow=allow, allow_row=allow_row, **kw)
            plain = ks.slot_stats_triton(h, nw, 1e-5, hw, ban=ban, **kw)
            out["restricted"][_case_id(case)] = {
                "kernel": [t.tolist() for t in got],
                "plain": [t.tolist() for t in plain],
            }
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            out["restricted"][_case_id(case)] = {"error": repr(e)}

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


@pytest.mark.parametrize("case", RESTRICTED, ids=[_case_id(c) for c in RESTRICTED])
def test_restricted_kernel_matches_reference(interpreted, case):
    """Rows over their allowed sets match the reference; unrestricted rows are bit for bit what the
    kernel gives without `allow`."""
    M, D, V, dt, ban, _ = case
    res = interpreted["restricted"][_case_id(case)]
    assert "error" not in res, res.get("error")
    dtype, atol, rtol = DTYPES[dt]
    h, nw, hw = _inputs(M, D, V, dtype, seed=RESTRICTED.index(case))
    allow, allow_row = _allow_inputs(M, V, ban)
    want = ks.slot_stats_reference(h, nw, 1e-5, hw, ban=ban, allow=allow, allow_row=allow_row)
    _compare(res["kernel"], want, atol, rtol)
    pred = torch.tensor(res["kernel"][1])
    assert bool(allow[allow_row.clamp_min(0), pred][allow_row >= 0].all()), "a restricted row left its set"
    free = (allow_row < 0).nonzero().flatten().tolist()
    for name, a, b in zip(NAMES, res["kernel"], res["plain"]):
        assert [a[r] for r in free] == [b[r] for r in free], f"{name}: unrestricted rows changed"


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


def test_reference_restriction_matches_fp64_softmax():
    """A restricted row is the softmax renormalised over its set (the banned id excluded); an
    unrestricted row is bit for bit today's answer (fp32 on the CPU: the torch fallback)."""
    M, V, ban = 8, 500, 11
    h, nw, hw = _inputs(M, 40, V, torch.float32, seed=5)
    allow, allow_row = _allow_inputs(M, V, ban)
    allow[2, 0] = True  # set 2: ids 0, 1, 2 and the banned 11
    x = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    z = x @ hw.double().T  # (M, V)
    z[:, ban] = float("-inf")
    z[(allow_row >= 0)[:, None] & ~allow[allow_row.clamp_min(0)]] = float("-inf")
    p = z.softmax(-1)
    top = p.topk(2, dim=-1)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    want = (top.values[:, 0], top.indices[:, 0], top.values[:, 1], ent)
    got = ks.slot_stats_reference(h, nw, 1e-5, hw, ban=ban, allow=allow, allow_row=allow_row)
    _compare(got, want, 1e-6, 1e-5)
    one = (allow_row == 1).nonzero().flatten()  # set 1 holds the last id alone: certain, second 0, no entropy
    assert got[1][one].tolist() == [V - 1] * len(one) and got[0][one].eq(1).all() and got[2][one].eq(0).all()
    assert got[3][one].abs().max() < 1e-6
    plain = ks.slot_stats_reference(h, nw, 1e-5, hw, ban=ban)
    free = allow_row < 0
    assert free.any() and all(torch.equal(a[free], b[free]) for a, b in zip(got, plain))


def test_restriction_through_the_public_function(monkeypatch):
    """slot_stats takes allow/allow_row as keywords after the old positional arguments and passes
    them to the torch fallback on the CPU; a malformed restriction is a ValueError, checked without a sync."""
    import inspect

    params = inspect.signature(ks.slot_stats).parameters
    assert list(params)[:5] == ["h", "norm_w", "eps", "head_w", "ban"]
    for name in ("allow", "allow_row"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, nw, hw = _inputs(5, 32, 300, torch.float32)
    allow, allow_row = _allow_inputs(5, 300, 7)
    got = ks.slot_stats(h, nw, 1e-5, hw, 7, allow=allow, allow_row=allow_row)
    want = ks.slot_stats_reference(h, nw, 1e-5, hw, 7, allow=allow, allow_row=allow_row)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for bad in (
        {"allow": allow},
        {"allow_row": allow_row},
        {"allow": allow[:, :-1], "allow_row": allow_row},
        {"allow": allow.int(), "allow_row": allow_row},
        {"allow": allow, "allow_row": allow_row[:-1]},
        {"allow": allow, "allow_row": allow_row.int()},
    ):
        with pytest.raises(ValueError):
            ks.slot_stats(h, nw, 1e-5, hw, 7, **bad)


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
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
ks = importlib.import_module("kernels.slot_stats")
out = {}
for dt, bd, has_allow in (("fp32", 128, False), ("fp32", 128, True), ("bf16", 64, False), ("bf16", 64, True),
                          ("fp16", 16, True)):
    p = "*" + dt
    sig = {"h_ptr": p, "g_ptr": p, "w_ptr": p, "allow_ptr": "*u8", "allow_row_ptr": "*i64",
           "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32",
           "t1_ptr": "*fp32", "t1i_ptr": "*i32", "t2_ptr": "*fp32", "M": "i32", "D": "i32", "V": "i32",
           "stride_hm": "i32", "stride_wv": "i32", "stride_av": "i32", "eps": "fp32", "ban": "i32",
           "v_per_split": "i32", "BLOCK_M": "constexpr", "BLOCK_D": "constexpr", "BLOCK_V": "constexpr",
           "HAS_ALLOW": "constexpr", "INTERPRET": "constexpr"}
    src = ASTSource(ks.triton_kernel(), sig, constexprs={"BLOCK_M": 16, "BLOCK_D": bd, "BLOCK_V": 128,
                                                             "HAS_ALLOW": has_allow, "INTERPRET": False})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
    out[f"{dt}-allow{has_allow}"] = {"stages": sorted(asm), "mma": bool(re.search(r"\bw?mma", asm["ptx"]))}
print("RESULT " + json.dumps(out))
"""


def test_kernel_compiles_for_hopper_without_a_gpu():
    """Triton's compiler for an H200 (sm_90) runs on the CPU: the interpreter forgives what the compiler
    rejects (a plain float global read in the kernel passed every interpreted case and broke every GPU
    fill, found on the first H200 lease), so the kernel is compiled down to a cubin here too, with and
    without the allowed-set restriction. bf16/fp16 heads must reach tensor cores (mma in the PTX);
    fp32 keeps the exact fp32 dot (no mma)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    variants = json.loads(line[len("RESULT ") :])
    assert len(variants) == 5
    for name, res in variants.items():
        assert {"ttir", "ptx", "cubin"} <= set(res["stages"]), name
        assert res["mma"] == (not name.startswith("fp32")), f"{name}: tensor-core mma in the PTX is {res['mma']}"
