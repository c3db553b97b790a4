"""Softmax statistics of masked slots: final RMSNorm + LM head + max prob, argmax, second prob and
entropy per slot, without materialising the (slots, vocabulary) probabilities.

One ladder, Liger-style: `_slot_stats_kernel` (Triton) -> `slot_stats_triton` (launcher + combine of
the vocabulary splits) -> `slot_stats` (public; dispatch chosen once at import). The torch reference
`slot_stats_reference` is the oracle and the CPU path.

Dispatch: CUDA visible and Triton installed -> the kernel; otherwise the reference. DLM_KERNELS=torch
or =triton overrides at import, `set_backend()` at run time (tests). Triton is imported on the
kernel's first use (`triton_kernel`), never by a CPU engine: its import is 0.13 s of every CPU
engine's start. With TRITON_INTERPRET=1 set before Triton is first imported (Triton decorates its
own language library at import), the kernel runs on CPU tensors in Triton's interpreter: that is how
the tests check it without a GPU.

Precision: fp32 inputs are multiplied in fp32 (an "ieee" dot, like the reference). bf16/fp16 inputs
run the LM head on tensor cores: the normed row is rounded to the head's dtype and the dot accumulates
in fp32, so logits carry that dtype's input rounding (tolerances: tests/test_kernels.py).

Restriction (token healing): `allow` (A, V) bool holds A allowed sets of token ids and `allow_row`
(M,) int64 names each row's set, or -1 for none. A restricted row's statistics are those of its
logits with every id outside its set at -inf, i.e. of the distribution renormalised over the set;
`ban` still applies. Fixed shapes and no host sync, so a step can be captured; every set must hold
an id other than `ban` (an empty set gives unspecified statistics) and `allow_row` must lie in [-1, A).
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Any

import torch
import torch.nn.functional as F

# Triton is optional (CPU-only installs and non-Linux platforms run the reference) and imported by
# triton_kernel() on the kernel's first use, which sets these
triton: Any = None
tl: Any = None
_jitted: Any = None


Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (max_prob, argmax, top2_prob, entropy)


def _check_allow(allow: torch.Tensor | None, allow_row: torch.Tensor | None, M: int, V: int) -> bool:
    """Whether a restriction is given; ValueError for a malformed one (shapes and dtypes only: no sync)."""
    if allow is None and allow_row is None:
        return False
    if allow is None or allow_row is None:
        raise ValueError("allow and allow_row go together: pass both or neither")
    if allow.dtype != torch.bool or allow.dim() != 2 or allow.shape[1] != V:
        raise ValueError(f"allow must be a (A, {V}) bool tensor, got {tuple(allow.shape)} {allow.dtype}")
    if allow_row.dtype != torch.int64 or tuple(allow_row.shape) != (M,):
        raise ValueError(f"allow_row must be a ({M},) int64 tensor, got {tuple(allow_row.shape)} {allow_row.dtype}")
    return True


def slot_stats_reference(
    h: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    head_w: torch.Tensor,
    ban: int = -1,
    *,
    allow: torch.Tensor | None = None,
    allow_row: torch.Tensor | None = None,
) -> Stats:
    """(max_prob (M,), argmax (M,) long, top2_prob (M,), entropy (M,)), all fp32, of h (M, D): pre-norm
    hidden states of masked slots; head_w: (V, D); `ban` is a token id that may never be predicted (the
    mask token), or -1; `allow` (A, V) bool and `allow_row` (M,) int64: each row's allowed set or -1
    (module docstring)."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    logits = F.linear(x, head_w.float())  # (M, V)
    if ban >= 0:
        logits[:, ban] = float("-inf")
    if _check_allow(allow, allow_row, *logits.shape):
        assert allow is not None and allow_row is not None
        keep = allow[allow_row.clamp_min(0)] | (allow_row < 0)[:, None]  # (M, V); unrestricted rows keep all
        logits = logits.masked_fill(~keep, float("-inf"))
    logp = logits.log_softmax(-1)
    top = logp.topk(2, dim=-1)
    p = logp.exp()
    ent = -(p * logp.clamp_min(-1e30)).sum(-1)  # p=0 at a banned id: 0 * -inf would be nan
    return top.values[:, 0].exp(), top.indices[:, 0], top.values[:, 1].exp(), ent


# ---------------------------------------------------------------- Triton kernel
#
# For one slot row x (D,) with RMSNorm gain g (D,) and head W (V, D):
#   r   = 1 / sqrt(mean_d x_d^2 + eps)                     (final RMSNorm, fp32)
#   z_v = sum_d (x_d r g_d) W[v, d]                         (logit of token v; z_ban = NEG)
# The vocabulary is read in chunks of BLOCK_V with an online softmax. Running state per row:
#   m = max z seen so far,  s = sum_v exp(z_v - m),  u = sum_v (z_v - m) exp(z_v - m)
# When a chunk raises the max from m to m' (d = m - m' <= 0), the old sums are rescaled:
#   s' = e^d s,   u' = e^d (u + d s)            (since z - m' = (z - m) + d)
# and the chunk's own terms are added. At the end, with p_v = exp(z_v - m) / s:
#   max prob = exp(top1 - m) / s,   2nd prob = exp(top2 - m) / s,
#   entropy  = -sum_v p_v log p_v = -sum_v p_v (z_v - m - log s) = log s - u / s.
# u is kept relative to the running max (not sum z e^z) so it never loses precision to large logits.
# The dot: fp32 "ieee" for fp32 heads; for bf16/fp16 heads x r g is rounded to the head's dtype and
# multiplied on tensor cores with fp32 accumulation (products of two bf16/fp16 values are exact in fp32,
# so only that rounding separates it from the reference).
# Restricted rows (HAS_ALLOW): a row whose allow_row is a >= 0 reads byte allow[a, v] for each chunk
# (unrestricted rows' loads are masked off, no traffic) and treats v outside its set like the banned id.
# Masked entries (past V, the banned id, outside the allowed set) get the finite NEG rather than -inf:
# (NEG - m) * exp(NEG - m) is 0, where -inf * 0 would be nan.
# Top-2: each chunk's best and second best (the best position masked out) merge into the running
# pair; a strict > keeps the earliest index on ties, as argmax does. A chunk (or a split) with no
# allowed entry leaves m at NEG with s counting its NEG entries: the first real maximum rescales that
# junk by exp(NEG - m') = 0, as `_combine_splits` does across splits.
# The vocabulary may also be split across programs (grid axis 1) for parallelism at few slots; each
# split writes its (m, s, u, top1, top1 index, top2) and `_combine_splits` merges them in torch with
# the same rescaling rule.

NEG = -1.0e30
# what the kernel reads: compiled Triton accepts only constexpr globals (the interpreter took the float)
NEG_K: Any = NEG  # tl.constexpr(NEG) once Triton is imported (triton_kernel)


def _slot_stats_kernel(  # wrapped by triton.jit in triton_kernel()
    h_ptr,
    g_ptr,
    w_ptr,  # (M, D), (D,), (V, D)
    allow_ptr,
    allow_row_ptr,  # (A, V) uint8 (the bool mask's bytes), (M,) int64; unread unless HAS_ALLOW
    m_ptr,
    s_ptr,
    u_ptr,
    t1_ptr,
    t1i_ptr,
    t2_ptr,  # outputs (SPLIT, M) each
    M,
    D,
    V,
    stride_hm,
    stride_wv,
    stride_av,
    eps,
    ban,
    v_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_ALLOW: tl.constexpr,
    INTERPRET: tl.constexpr,  # Triton's CPU interpreter: see the bf16 dot below
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M

    # final RMSNorm: 1/rms per row (fp32 whatever the input dtype)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(
            h_ptr + rows[:, None] * stride_hm + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < D), other=0.0
        )
        x = x.to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(sumsq / D + eps)

    m_run = tl.full([BLOCK_M], NEG_K, dtype=tl.float32)
    s_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    u_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    t1 = tl.full([BLOCK_M], NEG_K, dtype=tl.float32)
    t2 = tl.full([BLOCK_M], NEG_K, dtype=tl.float32)
    t1i = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_ALLOW:
        set_id = tl.load(allow_row_ptr + rows, mask=row_ok, other=-1)  # (BLOCK_M,) int64
        restricted = set_id >= 0
        allow_rows = allow_ptr + tl.maximum(set_id, 0) * stride_av  # (BLOCK_M,) row pointers
    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    local = tl.arange(0, BLOCK_V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        vcols = v0 + local
        v_ok = vcols < v_hi
        z = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)  # (BLOCK_M, BLOCK_V) logits of this chunk
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            d_ok = cols < D
            x = tl.load(
                h_ptr + rows[:, None] * stride_hm + cols[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
            g = tl.load(g_ptr + cols, mask=d_ok, other=0.0)
            xn = x.to(tl.float32) * rstd[:, None] * g.to(tl.float32)[None, :]
            # int64 offsets: V x D reaches 2^31 elements at large vocabularies (152k x 14k)
            w = tl.load(
                w_ptr + vcols[None, :].to(tl.int64) * stride_wv + cols[:, None],
                mask=d_ok[:, None] & v_ok[None, :],
                other=0.0,
            )
            if w.dtype.is_bf16() or w.dtype.is_fp16():
                if INTERPRET and w.dtype.is_bf16():
                    # Triton 3.9's interpreter multiplies bf16 operands' raw bits (its dot sees uint16
                    # arrays) and truncates fp32 -> bf16: round to nearest even by hand as the GPU does,
                    # and multiply the rounded operands in fp32, which is exact for bf16 products
                    xb = xn.to(tl.uint32, bitcast=True)
                    xb = (xb + 0x7FFF + ((xb >> 16) & 1)) & 0xFFFF0000
                    z += tl.dot(xb.to(tl.float32, bitcast=True), w.to(tl.float32), input_precision="ieee")
                else:  # tensor cores: operands in the head's dtype (rounded to nearest even), fp32 accumulation
                    z = tl.dot(xn.to(w.dtype), w, acc=z)
            else:
                z += tl.dot(xn, w.to(tl.float32), input_precision="ieee")  # fp32 like the reference
        keep = v_ok[None, :] & (vcols[None, :] != ban)  # (BLOCK_M, BLOCK_V)
        if HAS_ALLOW:
            bits = tl.load(
                allow_rows[:, None] + vcols[None, :], mask=restricted[:, None] & v_ok[None, :], other=1
            )  # (BLOCK_M, BLOCK_V) uint8
            keep = keep & (bits != 0)
        z = tl.where(keep, z, NEG_K)

        b1 = tl.max(z, axis=1)
        b1i = tl.argmax(z, axis=1)
        b2 = tl.max(tl.where(local[None, :] == b1i[:, None], NEG_K, z), axis=1)
        better = b1 > t1
        t2 = tl.where(better, tl.maximum(t1, b2), tl.maximum(t2, b1))
        t1i = tl.where(better, v0 + b1i, t1i)
        t1 = tl.maximum(t1, b1)

        m_new = tl.maximum(m_run, b1)
        d = m_run - m_new
        alpha = tl.exp(d)
        zc = z - m_new[:, None]
        e = tl.exp(zc)
        u_run = alpha * (u_run + d * s_run) + tl.sum(zc * e, axis=1)
        s_run = alpha * s_run + tl.sum(e, axis=1)
        m_run = m_new

    out = pid_s * M + rows
    tl.store(m_ptr + out, m_run, mask=row_ok)
    tl.store(s_ptr + out, s_run, mask=row_ok)
    tl.store(u_ptr + out, u_run, mask=row_ok)
    tl.store(t1_ptr + out, t1, mask=row_ok)
    tl.store(t1i_ptr + out, t1i, mask=row_ok)
    tl.store(t2_ptr + out, t2, mask=row_ok)


def triton_installed() -> bool:
    """True when Triton can be imported (found without importing it)."""
    return triton is not None or find_spec("triton") is not None


def triton_kernel() -> Any:
    """The kernel as a triton.jit object, Triton imported on the first call; RuntimeError without
    Triton. The kernel's globals `tl` and `NEG_K` are set before it is first compiled."""
    global triton, tl, NEG_K, _jitted
    if _jitted is None:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError as e:
            raise RuntimeError("Triton is not installed") from e
        triton, tl = _triton, _tl
        NEG_K = tl.constexpr(NEG)  # compiled Triton reads only constexpr globals (the interpreter took the float)
        _jitted = triton.jit(_slot_stats_kernel)
    return _jitted


def launch_settings(M: int, D: int, V: int, device: torch.device) -> dict[str, int]:
    """BLOCK_M/D/V and the vocabulary split for a problem size (the one place launch settings live)."""
    triton_kernel()  # imports Triton
    block_m = 16  # tl.dot needs >= 16 rows
    block_d = min(128, max(16, triton.next_power_of_2(D)))
    if device.type == "cuda":
        block_v = 128
        # enough programs to fill the GPU at a handful of slots: split the vocabulary
        m_blocks = triton.cdiv(M, block_m)
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        split = max(1, min(triton.cdiv(V, block_v), (2 * n_sm) // m_blocks))
    else:  # the interpreter: ~0.7 ms per program and per loop trip, so few large blocks
        block_v = min(1024, max(16, triton.next_power_of_2(V)))
        split = 1
    return {"BLOCK_M": block_m, "BLOCK_D": block_d, "BLOCK_V": block_v, "split": split}


def _combine_splits(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, t1: torch.Tensor, t1i: torch.Tensor, t2: torch.Tensor
) -> Stats:
    """Merges per-split online-softmax states (SPLIT, M) into the final statistics (M,)."""
    mx = m.max(0).values  # (M,)
    scale = torch.exp(m - mx)
    S = (scale * s).sum(0)
    U = (scale * (u + (m - mx) * s)).sum(0)
    best = t1.argmax(0)  # first split on ties = lowest token id
    top1 = t1.gather(0, best[None]).squeeze(0)
    idx = t1i.gather(0, best[None]).squeeze(0).long()
    others = t1.scatter(0, best[None], NEG)  # the other splits' best values compete for second place
    top2 = torch.maximum(others.max(0).values, t2.gather(0, best[None]).squeeze(0))
    return torch.exp(top1 - mx) / S, idx, torch.exp(top2 - mx) / S, torch.log(S) - U / S


def slot_stats_triton(
    h: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    head_w: torch.Tensor,
    ban: int = -1,
    *,
    block_v: int | None = None,
    block_d: int | None = None,
    split: int | None = None,
    allow: torch.Tensor | None = None,
    allow_row: torch.Tensor | None = None,
) -> Stats:
    """The kernel's answer to slot_stats_reference (same signature and outputs); block_v, block_d and
    split override launch settings (tests cover odd blockings with them)."""
    kernel = triton_kernel()  # the triton.jit object: launched as kernel[grid](...)
    M, D = h.shape
    V = head_w.shape[0]
    h = h.contiguous()
    head_w = head_w.contiguous()
    has_allow = _check_allow(allow, allow_row, M, V)
    if has_allow:
        assert allow is not None and allow_row is not None
        allow_u8, rows_set = allow.contiguous().view(torch.uint8), allow_row.contiguous()
    else:  # never read (HAS_ALLOW is a constexpr): any tensor stands in
        allow_u8, rows_set = h, h
    st = launch_settings(M, D, V, h.device)
    bv = block_v or st["BLOCK_V"]
    bd = block_d or st["BLOCK_D"]
    sp = split or st["split"]
    # each split covers a whole number of vocabulary blocks
    per = triton.cdiv(triton.cdiv(V, sp), bv) * bv
    sp = triton.cdiv(V, per)
    m, s, u, t1, t2 = (torch.empty(sp, M, dtype=torch.float32, device=h.device) for _ in range(5))
    t1i = torch.empty(sp, M, dtype=torch.int32, device=h.device)
    grid = (triton.cdiv(M, st["BLOCK_M"]), sp)
    kernel[grid](
        h,
        norm_w,
        head_w,
        allow_u8,
        rows_set,
        m,
        s,
        u,
        t1,
        t1i,
        t2,
        M,
        D,
        V,
        h.stride(0),
        head_w.stride(0),
        allow_u8.stride(0),
        float(eps),
        int(ban),
        per,
        BLOCK_M=st["BLOCK_M"],
        BLOCK_D=bd,
        BLOCK_V=bv,
        HAS_ALLOW=has_allow,
        INTERPRET=_interpreted(),
    )
    if sp == 1:
        S, U, mx = s[0], u[0], m[0]
        return torch.exp(t1[0] - mx) / S, t1i[0].long(), torch.exp(t2[0] - mx) / S, torch.log(S) - U / S
    return _combine_splits(m, s, u, t1, t1i, t2)


# ---------------------------------------------------------------- dispatch


def _initial_backend() -> str:
    forced = os.environ.get("DLM_KERNELS", "").strip().lower()
    if forced in ("torch", "triton"):
        return forced
    return "triton" if torch.cuda.is_available() and triton_installed() else "torch"


_backend = _initial_backend()


def set_backend(name: str) -> str:
    """Switches the implementation ("triton" or "torch"); returns the previous one."""
    global _backend
    if name not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {name!r}")
    if name == "triton" and not triton_installed():
        raise RuntimeError("Triton is not installed")
    prev, _backend = _backend, name
    return prev


def backend() -> str:
    return _backend


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def slot_stats(
    h: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    head_w: torch.Tensor,
    ban: int = -1,
    *,
    allow: torch.Tensor | None = None,
    allow_row: torch.Tensor | None = None,
) -> Stats:
    """(max_prob, argmax, top2_prob, entropy) per slot row of h, each row over its allowed set when
    `allow`/`allow_row` restrict it; see slot_stats_reference."""
    if _backend == "triton" and (h.is_cuda or _interpreted()):
        return slot_stats_triton(h, norm_w, eps, head_w, ban, allow=allow, allow_row=allow_row)
    return slot_stats_reference(h, norm_w, eps, head_w, ban, allow=allow, allow_row=allow_row)
