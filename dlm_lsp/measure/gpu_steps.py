"""The GPU bench's step sections (dlm_lsp/measure/gpu_bench.py), on canvases of token ids: cached-step
ms by run rows and step mode, a profile of launches, syncs and the SDPA backend, forced-schedule fills."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dlm_lsp.measure.gpu_setup import Built, Clock, Setup, sync
from engine.api import DecodeOptions

if TYPE_CHECKING:
    from engine.decode.canvas import Canvas
    from engine.decode.static import StaticStep
    from engine.model.config import ModelConfig

ROWS = (16, 32, 48)  # run rows of the cached-step timings
FORCED_SLOTS = (32, 64)
FORCED_STEPS = (4, 8, 16)
LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SDPA_OPS = (  # the aten op SDPA dispatched to -> backend
    ("aten::_scaled_dot_product_flash_attention", "flash"),
    ("aten::_scaled_dot_product_efficient_attention", "efficient"),
    ("aten::_scaled_dot_product_cudnn_attention", "cudnn"),
    ("aten::_scaled_dot_product_attention_math", "math"),
)
SDPA_KERNELS = (("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient"), ("cudnn", "cudnn"))


def _canvas(s: Setup, cfg: ModelConfig, n: int, opts: DecodeOptions, shift: int = 0) -> Canvas:
    """A canvas of exactly s.context tokens around n slots (token ids only: no tokenizer)."""
    from engine.decode.forward import build_canvas

    room = s.context - n
    cut = room * 2 // 3
    w = s.words[shift:]
    return build_canvas(w[:cut], w[cut:room], n, cfg, opts, s.context, s.dev)


def _static(s: Setup, m: Built, mode: str) -> StaticStep | None:
    """The fixed-shape step of this mode for this model (one per mode, its graphs kept); None: the loop."""
    from engine.decode.static import StaticStep

    if mode == "loop":
        return None
    if mode not in m.statics:
        m.statics[mode] = StaticStep(m.model, mode, s.dev)
    return m.statics[mode]


def _fixed_rows(cfg: ModelConfig, rows: int) -> tuple[int, DecodeOptions]:
    """Slots and options whose cached steps each run exactly `rows` rows: one slot committed a step,
    no window, no freezing (every slot runs every step), the shifted families' extra row counted."""
    n = rows - (1 if cfg.logits_shift else 0)
    return n, DecodeOptions(heal=False, selection="topk", steps=n, window=0, freeze=False)


def _ready_canvas(s: Setup, m: Built, rows: int, st: StaticStep | None, shift: int) -> tuple[Canvas, float]:
    """A fixed-rows canvas past its full forward (timed: the ms are returned) and its first cached
    step (which loads it into the fixed-shape step's buffers)."""
    from engine.decode import sampler

    n, opts = _fixed_rows(m.cfg, rows)
    c = _canvas(s, m.cfg, n, opts, shift)
    with Clock(s.dev) as t:
        sampler.step(m.model, [c], static=st)
    sampler.step(m.model, [c], static=st)
    return c, t.ms


def cached_steps(s: Setup, m: Built) -> dict:
    """ms per cached step at 16 / 32 / 48 run rows in every mode, and each as a multiple of the floor."""
    from engine.decode import sampler

    out: dict[str, dict] = {}
    firsts: list[float] = []  # the full forwards of the context (every mode's canvases start with one)
    for rows in sorted(ROWS, reverse=True):  # the largest first: a fixed-shape state grows once
        k = min(s.timed_steps, _fixed_rows(m.cfg, rows)[0] - 3)
        row = {}
        for mode in s.modes:
            st = _static(s, m, mode)
            ms = []
            for r in range(s.reps + 1):  # the first: kernel selection, compilation, graph capture
                c, first_ms = _ready_canvas(s, m, rows, st, r)
                firsts += [first_ms] if r else []
                with Clock(s.dev) as t:
                    for _ in range(k):
                        sampler.step(m.model, [c], static=st)
                ms.append(t.ms / k)
                if st is not None:
                    st.leave(c)
            best = statistics.median(ms[1:])
            row[mode] = {"ms": best, "floor_ratio": best / m.floor_ms, "steps_timed": k, "reps": s.reps}
        out[str(rows)] = row
    m.step_ms = out["32"][s.fast]["ms"]
    return {
        "rows": dict(sorted(out.items(), key=lambda kv: int(kv[0]))),
        "first_forward_ms": statistics.median(firsts),
        "context_tokens": s.context,
    }


def profile(s: Setup, m: Built, steps: int = 4) -> dict:
    """Per mode, over `steps` cached steps at 32 rows: launches, syncs, copies, ops and the SDPA backend."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine.decode import sampler

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.dev.type == "cuda" else [])
    out = {}
    for mode in s.modes:
        st = _static(s, m, mode)
        c, _ = _ready_canvas(s, m, 32, st, 0)
        sampler.step(m.model, [c], static=st)  # one more outside the profile
        sync(s.dev)
        with torch_profile(activities=acts) as prof:
            for _ in range(steps):
                sampler.step(m.model, [c], static=st)
            sync(s.dev)
        out[mode] = count_events(((e.name, str(e.device_type) != "DeviceType.CPU") for e in prof.events()), steps)
        if st is not None:
            st.leave(c)
    return out


def count_events(events: Iterable[tuple[str, bool]], steps: int) -> dict:
    """Per step, from (name, on the device) profiler events: host launches (runtime and driver API),
    CUDA graph launches, device kernels, host syncs, device-to-host copies, aten ops; and the SDPA
    backends seen (the aten op dispatched, else the attention kernels' names)."""
    n = dict.fromkeys(("launches", "graph_launches", "kernels", "syncs", "dtoh_copies", "ops"), 0)
    ops: set[str] = set()
    kernels: set[str] = set()
    for name, on_device in events:
        if on_device:
            if name.startswith("Memcpy DtoH"):
                n["dtoh_copies"] += 1
            elif not name.startswith(("Memcpy", "Memset")):
                n["kernels"] += 1
                low = name.lower()
                kernels.update(b for key, b in SDPA_KERNELS if key in low)
            continue
        if name in LAUNCHES:
            n["launches"] += 1
        elif name == "cudaGraphLaunch":
            n["graph_launches"] += 1
        elif name in SYNCS:
            n["syncs"] += 1
        elif name.startswith("aten::"):
            n["ops"] += 1
            ops.update(b for op, b in SDPA_OPS if name.startswith(op))
    out: dict[str, Any] = {f"{k}_per_step": v / steps for k, v in n.items()}
    out["sdpa"] = sorted(ops or kernels)
    out["sdpa_from"] = "aten op" if ops else "kernel names" if kernels else "none seen"
    return out


def forced(s: Setup, m: Built) -> dict:
    """End-to-end fill ms (first forward included) of 32 and 64 slots in 4, 8 and 16 steps: loop vs fast."""
    from engine.decode import sampler

    out: dict[str, Any] = {}
    for n in sorted(FORCED_SLOTS, reverse=True):
        for k in FORCED_STEPS:
            opts = DecodeOptions(heal=False, selection="topk", steps=k)
            row: dict[str, Any] = {}
            for mode in ("loop", s.fast):
                st = _static(s, m, mode)
                ms, steps = [], []
                for r in range(min(s.reps, 2) + 1):  # two timed: 24 fills a mode, a block-causal one of ~50 steps
                    with Clock(s.dev) as t:
                        res = sampler.fill(m.model, _canvas(s, m.cfg, n, opts, r), static=st)
                    ms.append(t.ms)
                    steps.append(res.steps)
                row[mode] = {"ms": statistics.median(ms[1:]), "steps": steps[-1]}
            row["speedup"] = row["loop"]["ms"] / row[s.fast]["ms"]
            out[f"{n}x{k}"] = {"slots": n, "steps": k, **row}
    out = dict(sorted(out.items(), key=lambda kv: (kv[1]["slots"], kv[1]["steps"])))
    if m.cfg.attention == "block_causal":
        out["note"] = (
            f"block-causal: a step commits inside the leftmost block ({m.cfg.block_size} slots) only, so a plan of "
            "more slots a step than a block runs out early and the rest commit one a step (see each mode's steps)"
        )
    return out
